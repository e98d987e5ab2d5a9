"""The float32 islands: what transformers keeps in float32 whatever dtype a model is loaded in. A dtype copy
(`precision.cast_copy`) and a streamed model loading its units in float16 (`streamed.Streamed.set_dtype`) both keep
them, or a float16 trial measures a model no user runs (tests/test_precision.py checks every tiny family)."""

from __future__ import annotations

import re

from torch import nn

# Buffers computed in float32 under any load dtype (rotary frequencies).
KEEP_FP32_BUFFERS = ("inv_freq",)


def strict_fp32_pattern(model: nn.Module):
    """What transformers keeps in float32 under any load dtype (`_keep_in_fp32_modules_strict`: DeepSeek's router
    weights and score bias), as one pattern over parameter names; None where the model names nothing."""
    names = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    if not names:
        return None
    return re.compile("|".join(rf"(^|\.){re.escape(n)}($|\.)" for n in names))
