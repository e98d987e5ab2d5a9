"""Copies of a model in another float dtype, without a full-size copy of the original on the way."""

from __future__ import annotations

import copy
import re
from contextlib import contextmanager

import torch
from torch import nn

# Buffers transformers computes in float32 whatever dtype a model is loaded in (rotary frequencies): an fp16 trial
# must keep them so, or it measures a model no user runs (tests/test_precision.py checks every tiny family).
KEEP_FP32_BUFFERS = ("inv_freq",)


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` whose floating parameters and buffers are in `dtype` (tied weights stay tied), as
    `from_pretrained(..., dtype=dtype)` would load it: rotary frequency buffers stay float32.

    `deepcopy` is handed each tensor's cast copy up front, so only the cast tensors are allocated
    (`copy.deepcopy(model).half()` would first duplicate the whole float32 model).
    """
    memo: dict[int, object] = {}
    strict = strict_fp32_pattern(model)
    for name, p in model.named_parameters():
        if id(p) not in memo:
            keep = p.dtype == torch.float32 and strict is not None and strict.search(name)
            memo[id(p)] = nn.Parameter(p.detach().clone() if keep else _cast(p, dtype), requires_grad=p.requires_grad)
    for name, b in model.named_buffers():
        if id(b) not in memo:
            keep = b.dtype == torch.float32 and (name.endswith(KEEP_FP32_BUFFERS) or (strict is not None and strict.search(name)))
            memo[id(b)] = b.detach().clone() if keep else _cast(b, dtype)
    clone = copy.deepcopy(model, memo)
    if hasattr(clone, "config"):
        clone.config.dtype = dtype
    return clone


def strict_fp32_pattern(model: nn.Module):
    """What transformers keeps in float32 under any load dtype (`_keep_in_fp32_modules_strict`: DeepSeek's router
    weights and score bias), as one pattern over parameter names; None where the model names nothing."""
    names = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    if not names:
        return None
    return re.compile("|".join(rf"(^|\.){re.escape(n)}($|\.)" for n in names))


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()


@contextmanager
def in_dtype(model: nn.Module, dtype: torch.dtype, arith: str = "native"):
    """`with in_dtype(model, torch.float16) as half: half(...)`: the model computing in `dtype` as
    `from_pretrained(..., dtype=dtype)` would, for the duration. An in-memory model gets a `cast_copy` (freed
    after); a streamed one (halfsafe.engine) loads its units in `dtype` and is restored after. `arith`: how its
    float16 ops compute (halfsafe.engine.fp16_arith: "emulated" runs the matrix products as float32 kernels)."""
    from .device import exact_fp16_reductions
    from .fp16_arith import fp16_arith
    from .streamed import streamed_of

    streamed = streamed_of(model)
    if streamed is None:
        half = cast_copy(model, dtype)
        try:
            with exact_fp16_reductions(), fp16_arith(arith):
                yield half
        finally:
            del half
        return
    saved = streamed.set_dtype(dtype)
    try:
        with exact_fp16_reductions(), fp16_arith(arith):
            yield model
    finally:
        streamed.restore_dtype(saved)
