"""The safety margin: how many bits under 65504 a plan keeps every activation it can move, for the
longest context it is made for.

The peaks are measured on calibration samples of a few hundred tokens; a model then runs on contexts up
to its `max_position_embeddings`. The rule below extrapolates from the calibrated length to the context
asked for, with constants measured by `bench/fidelity/context_study.py` (results: bench/results/context_study.md):

    margin(N) = BASE_MARGIN_BITS + GROWTH_BITS_PER_DOUBLING * max(0, log2(N / calibrated tokens))

BASE_MARGIN_BITS covers text the calibration did not see, at the calibrated length; the growth term
covers what a longer context adds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Measured by bench/fidelity/context_study.py on Gemma 3 270M (fp32) from 128 to 32768 tokens (its full context):
# the peak is a massive activation on one fixed residual channel (163) at every position, the largest at
# BOS (103,821, block 14: position 0 sees only itself, so the same for every text and length); at other
# positions it rises from 97,993 (512 tokens) to 102,390 (32768): 0.06 bits over 6 doublings, at most
# 0.022 bits in any one doubling. The model-wide peak of the 32k stream, of each language and code alone
# and of a stream without BOS never exceeds what the default 8 x 512-token calibration sees (excess
# <= 0.00 bits); per block, the largest excess is 0.37 bits (an inside peak 1.4 bits below the model's).
# BASE_MARGIN_BITS is the allowance for unseen text at the calibrated length (1 bit: 2.7x the largest
# per-block excess measured); GROWTH_BITS_PER_DOUBLING is the measured worst growth per doubling (0.022)
# rounded up to 0.05: 1.30 bits for 32768 tokens from 512.
BASE_MARGIN_BITS = 1.0
GROWTH_BITS_PER_DOUBLING = 0.05
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len")


@dataclass(frozen=True)
class Margin:
    context_length: int  # the longest context the plan is made for
    calibrated_tokens: int  # the longest calibration sample
    bits: float  # every movable activation stays this many bits under 65504
    rule: str  # how `bits` was chosen

    def to_dict(self) -> dict:
        return asdict(self)


def margin_bits(context_length: int, calibrated_tokens: int) -> float:
    """The growth law (see the module docstring): bits under 65504 for `context_length` tokens."""
    doublings = max(0.0, math.log2(context_length / max(calibrated_tokens, 1)))
    return BASE_MARGIN_BITS + GROWTH_BITS_PER_DOUBLING * doublings


def model_context_length(config) -> int | None:
    """The longest context the model's config admits (None where it names none, e.g. T5)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in POSITION_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def choose_margin(config, calibrated_tokens: int, max_context: int | None = None, headroom_bits: float | None = None) -> Margin:
    """The margin for `max_context` tokens (default: the model's own longest context, else the
    calibrated length). An explicit `headroom_bits` overrides the rule. Both were checked where they were asked for
    (halfsafe.requests.MarginOptions)."""
    context = max_context or model_context_length(config) or calibrated_tokens
    if headroom_bits is not None:
        return Margin(context, calibrated_tokens, float(headroom_bits), "set by --headroom-bits")
    bits = margin_bits(context, calibrated_tokens)
    return Margin(context, calibrated_tokens, bits,
                  f"{BASE_MARGIN_BITS:g} + {GROWTH_BITS_PER_DOUBLING:g} x log2({context} / {calibrated_tokens}) bits "
                  f"(halfsafe.core.margin, measured by bench/fidelity/context_study.py)")
