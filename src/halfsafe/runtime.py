"""Loading a converted checkpoint as the all-float16 model it is, with no module quietly kept in float32.

transformers keeps every module a model class lists in `_keep_in_fp32_modules` in float32 whenever a checkpoint
is loaded with dtype=torch.float16 (T5, mT5, UMT5 list `wo`). For an unconverted bf16 T5 that keeps `wo` from
overflowing; but `wo`'s float32 output, added to the float16 residual, promotes the residual stream to float32
from the first feed-forward on: more memory, slower, not what an fp16-only runtime or export computes, and it
hides whether the float16 model is really safe. A halfsafe-converted checkpoint needs none of it.

In transformers 5, `from_pretrained` reads that list from the new model instance, which `post_init` fills from
the class attribute of the model and of every PreTrainedModel inside it (T5's encoder and decoder T5Stack)
while the model is being built. So the list must be emptied on the class that defines it (T5PreTrainedModel),
before loading: setting it on T5ForConditionalGeneration alone leaves T5Stack's `wo` in.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import PretrainedConfig, PreTrainedModel

from .sites import Hooks

_ATTR = "_keep_in_fp32_modules"


@contextmanager
def pure_fp16(model_class: type):
    """Within the block, `model_class.from_pretrained(..., dtype=torch.float16)` keeps no module in float32.

    It empties the list on every class `model_class` inherits it from, so while open it applies to every load
    of those classes in the process (not thread-safe). Auto classes pick their model class only inside
    `from_pretrained`, so for them this does nothing: use `load_pure_fp16`.
    """
    owners = {c: c.__dict__[_ATTR] for c in model_class.__mro__ if c.__dict__.get(_ATTR)}
    for c in owners:
        setattr(c, _ATTR, None)
    try:
        yield
    finally:
        for c, value in owners.items():
            setattr(c, _ATTR, value)


@torch.no_grad()
def load_pure_fp16(model_class: type, path, **kwargs) -> PreTrainedModel:
    """`model_class.from_pretrained(path, dtype=torch.float16, **kwargs)` with every floating parameter in float16.

    `model_class` may be a model class (T5ForConditionalGeneration) or an Auto class. Modules that an Auto class
    still kept in float32 are cast after loading: for a float16 checkpoint that is exact (float16 -> float32 ->
    float16), otherwise it is the same single rounding a direct float16 load does; it only costs their float32
    size in memory for a moment.
    """
    from .trust import from_pretrained

    with pure_fp16(model_class):
        model = from_pretrained(model_class, path, dtype=torch.float16, **kwargs)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float16:
            p.data = p.data.to(torch.float16)
    return model


# ---------------------------------------------------------------------------------------------------------------
# A run-time option for an fp16 model that does need code at run time (a halfsafe checkpoint does not):
# keep_residual_fp32 (the residual stream in float32, weights and matmuls in float16), and the residual writers
# (from the family data) both it and the clamp baseline (halfsafe.baselines) rely on.
# ---------------------------------------------------------------------------------------------------------------

import types  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from .errors import HalfsafeError  # noqa: E402
from .families import family_for  # noqa: E402
from .layers import find_blocks  # noqa: E402


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
    """Modules that multiply their input by a weight matrix: nn.Linear, transformers' Conv1D (GPT-2), and the
    MoE routers and fused experts (`...TopKRouter`, `...Experts`: F.linear / @ on their own parameters)."""
    name = type(m).__name__
    if name.endswith(("Experts", "TopKRouter", "TopkRouter")) and next(m.children(), None) is None:
        return any(p.is_floating_point() for p in m.parameters(recurse=False))
    return isinstance(m, nn.Linear) or (name == "Conv1D" and isinstance(getattr(m, "weight", None), torch.Tensor))


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
        for name, m in model.named_modules():
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
