"""A model computing in another float dtype: a copy without a full-size copy of the original on the way, or a
streamed model loading its units in that dtype."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from .device import exact_fp16_reductions
from .fp16_arith import fp16_arith
from .islands import KEEP_FP32_BUFFERS, strict_fp32_pattern
from .streamed import streamed_of


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


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()


@contextmanager
def as_dtype(model: nn.Module, dtype: torch.dtype):
    """`with as_dtype(model, torch.bfloat16) as m: m(...)`: the model computing in `dtype` as
    `from_pretrained(..., dtype=dtype)` would, for the duration. An in-memory model gets a `cast_copy` (freed
    after); a streamed one loads its units in `dtype` and is restored after, also when the block fails."""
    streamed = streamed_of(model)
    if streamed is None:
        half = cast_copy(model, dtype)
        try:
            yield half
        finally:
            del half
        return
    saved = streamed.set_dtype(dtype)
    try:
        yield model
    finally:
        streamed.restore_dtype(saved)


@contextmanager
def in_dtype(model: nn.Module, dtype: torch.dtype, arith: str = "native"):
    """`as_dtype` for a float16 trial: reductions kept in float32 (`device.exact_fp16_reductions`) and `arith`, how its
    float16 ops compute (halfsafe.engine.fp16_arith: "emulated" runs the matrix products as float32 kernels)."""
    with as_dtype(model, dtype) as half, exact_fp16_reductions(), fp16_arith(arith):
        yield half
