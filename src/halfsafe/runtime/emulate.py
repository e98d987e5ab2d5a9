"""Run a transformers model under a runtime profile's arithmetic (halfsafe.runtime.profiles), on CPU, by patching it.

Each module gets the forward the profile gives it:
- a norm (RMSNorm-type: a class named ...RMSNorm or T5's LayerNorm; or nn.LayerNorm) whose statistic the profile
  puts in float16: kernels.generic's, the statistic chain in float16 (a norm whose forward ran without a mean of a
  square is an error: its statistic would silently not be emulated); a norm under the profile's graph kernels:
  that kernel module's (kernels.ort_webgpu: ReduceMean's order, the fused LayerNormalization);
- nn.Linear and GPT-2's Conv1D, where the profile accumulates in float16: arith16.matmul16 (float16 accumulation
  over runs of `matmul_chunk`), bias in fp16; under a profile's `split_k`, an nn.Linear's K (the head's too) cut
  into the groups the export cuts it into (SplitK.groups_for: by kind and K);
- attention: the kernel module's attention function, registered with eager masks;
- activation modules: the kernel module's, where it has its own (kernels.ort_webgpu).

The `torch` profile patches nothing. Fused MoE experts and embeddings keep PyTorch's arithmetic. The kernels of
each kind of float16 arithmetic live in halfsafe.runtime.kernels, one module each.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..core import arith16
from ..core.linears import is_linear, out_in_weight
from ..engine.wide import WideWeight
from .baselines import RuntimeHandle
from .kernels import generic, kernels_for
from .kernels.common import calls  # noqa: F401  (emulate.calls: what a run reached, by kind)
from .profiles import FP16_STATS, GRAPH_KERNELS, RuntimeProfile


def is_rms_norm(m: nn.Module) -> bool:
    """RMSNorm-type: a class named ...RMSNorm, or T5's (T5, MT5, LongT5, UMT5 ...LayerNorm, an RMSNorm)."""
    name = type(m).__name__
    return not isinstance(m, nn.LayerNorm) and (name.endswith("RMSNorm") or name.endswith("T5LayerNorm"))


def _linear_forward(profile: RuntimeProfile, kind: str = "linear", halves: bool = True):
    """K cut into the groups the profile's split-K gives this `kind` of product and its K, as `export onnx --runtime
    P` writes it (arith16.split_matmul16)."""
    def product(x, w):
        groups = profile.linear_split(kind, w.shape[1])
        if groups > 1:
            return arith16.split_matmul16(x, w, profile.matmul_chunk, groups, halves)
        return arith16.matmul16(x, w, profile.matmul_chunk)

    def forward(self, x):
        calls["linear"] += 1
        w = out_in_weight(self)
        if isinstance(w, WideWeight):  # a streamed matrix too big to hold: its output rows a chunk at a time
            step = w.chunk_rows()
            y = torch.cat([product(x, w.rows(s, min(s + step, w.shape[0]))) for s in range(0, w.shape[0], step)], dim=-1)
        else:
            y = product(x, w)
        if self.bias is not None:
            y = arith16.r16(y + arith16.r16(self.bias.float()))
        return y.to(x.dtype)

    return forward


def _register_attention(profile: RuntimeProfile) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    name, function = kernels_for(profile.kernels).attention(profile)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def is_activation(m: nn.Module) -> bool:
    """An activation module: transformers' (ACT2FN's classes) or torch's SiLU, GELU, Tanh, Sigmoid."""
    return isinstance(m, (nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid)) or type(m).__module__ == "transformers.activations"


def _configs(model: nn.Module):
    seen = []
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation") and all(c is not s for s in seen):
            seen.append(c)
    return seen


def emulate_runtime(model: nn.Module, profile: RuntimeProfile) -> RuntimeHandle:
    """Patch `model` to compute what `profile` puts in float16; `handle.remove()` (or leaving `with handle:`)
    restores it. Meant for a float16 model (the intermediate quantities are then float16 values)."""
    handle = RuntimeHandle()
    if profile.is_torch:
        return handle
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    try:
        for m in model.modules():
            patched = _patched_forward(m, profile, head)
            if patched is not None:
                m.forward = types.MethodType(patched, m)
                handle.add_undo(lambda m=m: m.__dict__.pop("forward", None))
        if profile.attention_kernels is not None:
            name = _register_attention(profile)
            for c in _configs(model):
                before = c._attn_implementation
                c._attn_implementation = name
                handle.add_undo(lambda c=c, before=before: setattr(c, "_attn_implementation", before))
    except BaseException:
        handle.remove()
        raise
    return handle


def _patched_forward(m: nn.Module, profile: RuntimeProfile, head):
    """The forward `profile` gives module `m` (None: its own): a norm as the profile computes norms, else a linear
    layer when the profile accumulates in float16, else an activation under the profile's graph kernels."""
    rms = is_rms_norm(m)
    if rms or isinstance(m, nn.LayerNorm):
        arith = profile.norm_arith(rms)
        if arith == FP16_STATS:
            return generic.fp16_stats_norm_forward(type(m).forward.__get__(m), profile, rms)
        if arith == GRAPH_KERNELS:
            return kernels_for(profile.kernels).graph_norm_forward(type(m).forward.__get__(m), profile)
        return None
    if profile.accumulates_fp16 and is_linear(m):
        # the export splits the K of MatMuls with a weight (not GPT-2's Conv1D, a Gemm); the head's partials
        # are added as neighbours, the others' as halves (halfsafe.export.onnx_split_k)
        kind = "head" if m is head else "linear" if isinstance(m, nn.Linear) else "conv1d"
        return _linear_forward(profile, kind, halves=m is not head)
    if profile.graph_activations and is_activation(m):
        return kernels_for(profile.kernels).activation_forward(type(m).forward.__get__(m))
    return None
