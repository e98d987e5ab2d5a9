"""What people do today instead of an exact rescale, as run-time patches to compare against (`halfsafe verify`).

- `clamp_residual_adds`: clamp every residual add to +-32752, as the fp16 ONNX exports of Gemma 3 do (a Clip
  node after each residual Add). Finite, but it silently changes the function wherever the stream is larger.
- `halfsafe.runtime.keep_residual_fp32`: weights and matmuls in fp16, the residual stream in fp32.

Both need custom code at run time; a halfsafe checkpoint needs none.
"""

from __future__ import annotations

import torch
from torch import nn

from .runtime import RuntimeHandle, residual_writers

ONNX_CLAMP = 32752.0  # the bound fp16 ONNX exports of Gemma 3 clip each residual add to (65504 / 2, less a margin)

_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
         torch.Tensor.__iadd__}


class _ResidualWrite(torch.Tensor):
    """A branch output on its way into the residual stream (a residual writer's output, marked by a forward
    hook without copying). Adding it to an unmarked tensor (the residual) is a residual add: the sum is
    clamped to +-limit and comes back unmarked. Write + write (GPT-NeoX's parallel `mlp + attn + h`) stays a
    write, so that the add into the residual is the one clamped. Other ops (dropout, views, casts) keep the mark.
    """

    limit: float = ONNX_CLAMP
    counter: list | None = None  # [number of clamped residual adds], shared with the handle

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ADDS:
            return super().__torch_function__(func, types, args, kwargs)
        operands = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if all(isinstance(a, _ResidualWrite) for a in operands):
            return out.as_subclass(cls) if not isinstance(out, cls) else out
        out = out.as_subclass(torch.Tensor)
        if not out.is_floating_point() or cls.limit < torch.finfo(out.dtype).max:
            out.clamp_(-cls.limit, cls.limit)  # NaN stays NaN, +-inf becomes +-limit
        if cls.counter is not None:
            cls.counter[0] += 1
        return out


class ClampHandle(RuntimeHandle):
    """`remove()` takes the clamp off; `adds` counts the residual adds clamped so far."""

    def __init__(self, counter: list) -> None:
        super().__init__()
        self._counter = counter

    @property
    def adds(self) -> int:
        return self._counter[0]


def clamp_residual_adds(model: nn.Module, limit: float = ONNX_CLAMP) -> ClampHandle:
    """Clamp each residual add of `model` to +-`limit` (default: the fp16 ONNX exports' 32752).

    Mechanism: the residual sum `h = residual + branch` happens inside each block's forward, not at a module
    boundary, so no hook on a module output can clamp it (clamping the block output misses the mid-block add;
    clamping the branch output bounds the write, not the sum; a patched forward per architecture would copy
    transformers code and go stale). Instead a forward hook marks each residual writer's output (the
    post-norms of Gemma 2/3, o_proj/down_proj of Llama-style blocks; the family's `residual_writers`) as a tensor
    subclass whose `+` clamps the sum: exactly one clamp per residual add, at the add, in the add's dtype, with
    the model's own forward code untouched. `handle.adds` counts them (2 per block and forward for a decoder).
    """
    counter = [0]
    cls = type("ClampedResidualWrite", (_ResidualWrite,), {"limit": float(limit), "counter": counter})
    handle = ClampHandle(counter)
    modules = dict(model.named_modules())

    def mark(module, args, out):
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):  # gpt-oss's MoE block: (out, scores)
            return (out[0].as_subclass(cls), *out[1:])
        return out.as_subclass(cls) if isinstance(out, torch.Tensor) else out

    try:
        for name in residual_writers(model):
            handle.add_post(modules[name], mark)
    except BaseException:
        handle.remove()
        raise
    return handle
