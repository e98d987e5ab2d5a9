"""What a linear layer is, decided once: nn.Linear, and transformers' GPT-2 `Conv1D` (y = x @ W + b, its weight
stored [in, out]). The runtime emulation, its measurements and the fp32-residual baseline all ask here."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def is_linear(m: nn.Module) -> bool:
    """nn.Linear, or a Conv1D holding its weight (a class of that name without one is something else)."""
    return isinstance(m, nn.Linear) or (_is_conv1d(m) and isinstance(getattr(m, "weight", None), torch.Tensor))


def out_in_weight(m: nn.Module) -> torch.Tensor:
    """A linear layer's weight as [out, in], the layout of nn.Linear: Conv1D's transposed (a view, nothing copied)."""
    w = cast(torch.Tensor, m.weight)  # is_linear's layers hold their weight as a tensor
    return w.t() if _is_conv1d(m) else w


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D"  # transformers' class, matched by name: no import of transformers' pytorch_utils
