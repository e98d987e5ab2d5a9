"""What people do today instead of an exact rescale, as run-time patches to compare against (`halfsafe verify`).

- `clamp_residual_adds`: clamp every residual add to +-32752, as the fp16 ONNX exports of Gemma 3 do (a Clip
  node after each residual Add). Finite, but it silently changes the function wherever the stream is larger.
- `keep_residual_fp32`: weights and matmuls in fp16, the residual stream in fp32.

Both need custom code at run time; a halfsafe checkpoint needs none. Both find the residual stream through the
family data's residual writers (`residual_writers`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..core.linears import is_linear
from ..core.sites import Hooks, find_blocks
from ..errors import HalfsafeError
from ..families import family_for


def residual_writers(model: nn.Module) -> list[str]:
    """Names of the modules whose outputs are added to the residual stream, every block of `model`: in each
    block, the first of its family's writer sets (`Family.residual_writers`) whose modules all exist."""
    family = family_for(model.config.model_type)
    modules = dict(model.named_modules())
    blocks = find_blocks(model)
    if not blocks:
        raise HalfsafeError(f"{type(model).__name__} has no repeated blocks: no residual stream to find")
    out = []
    for block in blocks:
        for names in family.residual_writers:
            if all(f"{block}.{n}" in modules for n in names):
                out.extend(f"{block}.{n}" for n in names)
                break
        else:
            raise HalfsafeError(
                f"no known residual writers in {block} ({type(modules[block]).__name__}): "
                f"add its branch-output modules to the residual_writers of family {family.name} (halfsafe/families/)"
            )
    return out


class RuntimeHandle(Hooks):
    """Undo for a run-time patch: `remove()` (or leave the `with` block) takes every hook and patch off."""


def _is_matmul_module(m: nn.Module) -> bool:
    """Modules that multiply their input by a weight matrix: a linear layer (core.linears.is_linear), and the
    MoE routers and fused experts (`...TopKRouter`, `...Experts`: F.linear / @ on their own parameters)."""
    name = type(m).__name__
    if name.endswith(("Experts", "TopKRouter", "TopkRouter")) and next(m.children(), None) is None:
        return any(p.is_floating_point() for p in m.parameters(recurse=False))
    return is_linear(m)


def _param_dtype(m: nn.Module) -> torch.dtype:
    return m.weight.dtype if isinstance(getattr(m, "weight", None), torch.Tensor) else next(m.parameters()).dtype


def _cast_floats(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    return obj


def _layer_norm_fp32(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    w = self.weight.float() if self.weight is not None else None
    b = self.bias.float() if self.bias is not None else None
    return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)


def _block_input_to_fp32(module, args, kwargs):
    """Forward pre-hook (with kwargs) on a block: its hidden-state input becomes float32."""
    if args:
        return (_cast_floats(args[0], torch.float32), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": _cast_floats(kwargs["hidden_states"], torch.float32)}
    return None


def _towers(model: nn.Module) -> list[nn.Module]:
    """Sub-models built from a non-text sub-config (a vision tower: `config.vision_config`)."""
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        return []
    subs = [c for c in vars(config).values() if isinstance(c, PretrainedConfig) and c is not config.get_text_config()]
    return [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel) and any(m.config is c for c in subs)]


def _outputs_to_weight_dtype(module, args, out):
    """A tower's outputs in its weight dtype, as a plain fp16 run gives them to what reads them (Gemma 3's
    projector multiplies by a bare fp16 parameter): the fp32 residual stays inside the tower."""
    dtype = next(module.parameters()).dtype
    for k, v in list(out.items()) if hasattr(out, "items") else []:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out[k] = v.to(dtype)
    return out


def keep_residual_fp32(model: nn.Module) -> RuntimeHandle:
    """Run `model` (float16 weights) with its residual stream in float32: every weight, matmul and attention
    stays float16, but each block receives its hidden states in float32, so each residual add promotes to
    float32 and the stream itself never overflows. Returns a handle; `handle.remove()` restores the model.

    How: a pre-hook on every block (`layers.find_blocks`) casts its hidden-state input to float32 (the
    embeddings, attention masks and rotary tables are still made in float16, as in a plain fp16 run); every
    linear layer casts its input back to its weight dtype, so matmuls stay fp16; norms that write into the
    residual (Gemma 2/3 post-norms, which compute in fp32 and return their input's dtype) get float32 input, so
    their writes are not rounded to fp16; nn.LayerNorm computes in float32 (PyTorch refuses fp32 input with
    fp16 weights). The final norm reads the float32 stream. A vision tower's outputs return to float16 (`_towers`).
    Custom runtime code: an fp16-only runtime or
    export cannot do this; the residual costs twice the activation memory.
    """
    modules = dict(model.named_modules())
    writer_norms = [n for n in residual_writers(model) if "norm" in type(modules[n]).__name__.lower()]
    handle = RuntimeHandle()
    try:
        for block in find_blocks(model):
            handle.add_pre(modules[block], _block_input_to_fp32, with_kwargs=True)
        for m in model.modules():
            if _is_matmul_module(m):
                handle.add_pre(m, lambda mod, args: (_cast_floats(args[0], _param_dtype(mod)), *args[1:]))
            elif isinstance(m, nn.LayerNorm):
                m.forward = types.MethodType(_layer_norm_fp32, m)
                handle.add_undo(lambda m=m: m.__dict__.pop("forward", None))
        for name in writer_norms:
            handle.add_pre(modules[name], lambda mod, args: (_cast_floats(args[0], torch.float32), *args[1:]))
        for tower in _towers(model):
            handle.add_post(tower, _outputs_to_weight_dtype)
    except BaseException:
        handle.remove()
        raise
    return handle


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
