"""Copies of a model in another float dtype, without a full-size copy of the original on the way."""

from __future__ import annotations

import copy

import torch
from torch import nn


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` whose floating parameters and buffers are in `dtype` (tied weights stay tied).

    `deepcopy` is handed each tensor's cast copy up front, so only the cast tensors are allocated
    (`copy.deepcopy(model).half()` would first duplicate the whole float32 model).
    """
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_cast(p, dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = _cast(b, dtype)
    clone = copy.deepcopy(model, memo)
    if hasattr(clone, "config"):
        clone.config.dtype = dtype
    return clone


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()
