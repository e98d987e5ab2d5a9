"""Run a transformers model under a runtime profile's arithmetic (halfsafe.runtime.profiles), on CPU, by patching it.

- RMSNorm-type norms (any module whose class name ends in "RMSNorm", or T5's "LayerNorm" that is no nn.LayerNorm):
  inside their forward, the statistic chain the modeling code writes (`x.pow(2)` / `x.square()`, `.mean(-1)`,
  `+ eps`, `torch.rsqrt` / `torch.pow(., -0.5)`) is computed in float16 (arith16); everything else in the norm
  (the `x * rsqrt`, the gain, its `1 + w`) stays as the modeling code computes it. A norm whose forward ran without
  such a mean is an error: its statistic would silently not be emulated.
- nn.LayerNorm (and F.layer_norm called inside a norm): arith16.layer_norm16, decomposed in float16.
- nn.Linear and GPT-2's Conv1D: arith16.matmul16 (float16 accumulation over runs of `matmul_chunk`), bias in fp16;
  under a profile's `split_k`, an nn.Linear's K (the head's too) cut into groups as the export cuts it.
- attention: a registered attention function (eager masks) doing QK^T and PV as the linears do, the scale, softcap,
  mask and softmax in float16. Under `kernels="ort-webgpu"`, as the exported graph's decomposed SDPA runs there:
  q and k each scaled by sqrt(scale), the online softmax of arith16_webgpu.
- `kernels="ort-webgpu"`: activation modules compute their float16 ops as the exported graph's run there, after
  ONNX Runtime's own fusions (GraphActivation: GELU (tanh), SiLU as QuickGelu, gelu_new as FastGelu, sigmoid,
  tanh, pow); norms compute their statistic's mean in ReduceMean's order and nn.LayerNorm as the fused kernel does
  (GraphNorm).

The `torch` profile patches nothing. Fused MoE experts and embeddings keep PyTorch's arithmetic.
"""

from __future__ import annotations

import math
import types
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core import arith16, arith16_webgpu
from ..core.linears import is_linear, out_in_weight
from ..engine.wide import WideWeight
from ..errors import HalfsafeError
from .baselines import RuntimeHandle
from .profiles import FP16_STATS, GRAPH_KERNELS, RuntimeProfile

ATTENTION_NAME = "halfsafe_fp16"
WEBGPU_ATTENTION_NAME = "halfsafe_ort_webgpu"


calls: Counter = Counter()  # emulated calls by kind ("norm", "layer_norm", "linear", "attention", "activation"): what a run reached


def _layer_norm_args(args, kwargs) -> tuple:
    """F.layer_norm's (x, weight, bias, eps), as called; one counted emulated call. The float16 emulation covers the
    last dim only."""
    shape = args[1]
    if len(shape) != 1:
        raise HalfsafeError(f"layer_norm over {len(shape)} dims: the float16 emulation covers the last dim only")
    calls["layer_norm"] += 1
    return (args[0], kwargs.get("weight", args[2] if len(args) > 2 else None),
            kwargs.get("bias", args[3] if len(args) > 3 else None), kwargs.get("eps", args[4] if len(args) > 4 else 1e-5))


def is_rms_norm(m: nn.Module) -> bool:
    """RMSNorm-type: a class named ...RMSNorm, or T5's (T5, MT5, LongT5, UMT5 ...LayerNorm, an RMSNorm)."""
    name = type(m).__name__
    return not isinstance(m, nn.LayerNorm) and (name.endswith("RMSNorm") or name.endswith("T5LayerNorm"))


class NormStats16(TorchFunctionMode):
    """Inside one norm's forward: the square, its mean over the last dim, + eps and the inverse square root in
    float16. Tensors that descend from the square are tracked by id, so other arithmetic (Gemma's `1 + w`) is left
    alone. `layernorm`: F.layer_norm calls become arith16.layer_norm16."""

    def __init__(self, rms: bool, layernorm: bool, lanes: int) -> None:
        super().__init__()
        self.rms, self.layernorm, self.lanes = rms, layernorm, lanes
        self.tracked: set[int] = set()
        self._alive: list[torch.Tensor] = []
        self.means = 0
        self.layer_norms = 0

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        self.tracked.add(id(t))
        self._alive.append(t)  # held for the norm's forward: a freed tensor's id could name a new one
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.layernorm and func is F.layer_norm:
            self.layer_norms += 1
            x, weight, bias, eps = _layer_norm_args(args, kwargs)
            return arith16.layer_norm16(x, weight, bias, eps, self.lanes).to(x.dtype)
        if not self.rms:
            return func(*args, **kwargs)
        tracked = [a for a in args if isinstance(a, torch.Tensor) and id(a) in self.tracked]
        if (name in ("pow", "__pow__") and len(args) > 1 and args[1] == 2) or name == "square":
            out = func(*args, **kwargs)
            return self._mark(arith16.r16(out.float()).to(out.dtype))
        if name == "mean" and tracked:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim not in (-1, x.dim() - 1, [-1], (-1,)):
                return func(*args, **kwargs)
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            out = arith16.mean16(x.float(), self.lanes)
            self.means += 1
            calls["norm"] += 1
            return self._mark((out.unsqueeze(-1) if keepdim else out).to(x.dtype))
        if tracked and name in ("add", "__add__", "__radd__") and any(isinstance(a, (int, float)) for a in args):
            eps = next(a for a in args if isinstance(a, (int, float)))
            return self._mark(arith16.r16(tracked[0].float() + arith16.scalar16(eps)).to(tracked[0].dtype))
        if tracked and (name == "rsqrt" or (name == "pow" and len(args) > 1 and args[1] == -0.5)):
            out = func(*args, **kwargs)
            return arith16.r16(out.float()).to(out.dtype)
        return func(*args, **kwargs)


class GraphNorm(TorchFunctionMode):
    """Inside one norm's forward under kernels="ort-webgpu", what the exported graph's norm ops compute there: the
    mean over the last dim of a square (RMSNorm's statistic) in the square's own dtype as ReduceMean adds it up
    (float32: arith16_webgpu.mean32; float16: arith16.mean16), F.layer_norm of float16 as the fused
    LayerNormalization kernel (arith16_webgpu.layer_norm16). The rest as the modeling code computes it (measured on
    Gemma 3 270M: then the graph's float32 norm outputs are bit for bit these)."""

    def __init__(self, lanes: int) -> None:
        super().__init__()
        self.lanes = lanes
        self.squares: list[torch.Tensor] = []  # held for the norm's forward: a freed tensor's id could name a new one

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is F.layer_norm and args[0].dtype == torch.float16:
            x, weight, bias, eps = _layer_norm_args(args, kwargs)
            return arith16_webgpu.layer_norm16(x, weight, bias, eps).to(x.dtype)
        out = func(*args, **kwargs)
        if (name in ("pow", "__pow__") and len(args) > 1 and args[1] == 2) or name == "square":
            self.squares.append(out)
        elif name == "mean" and any(args[0] is sq for sq in self.squares):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim in (-1, x.dim() - 1, [-1], (-1,)) and x.dtype in (torch.float32, torch.float16):
                keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
                mean = arith16_webgpu.mean32(x) if x.dtype == torch.float32 else arith16.mean16(x.float(), self.lanes)
                calls["norm"] += 1
                return (mean.unsqueeze(-1) if keepdim else mean).to(x.dtype)
        return out


def _graph_norm_forward(original, profile: RuntimeProfile):
    def forward(self, *args, **kwargs):
        with GraphNorm(profile.lanes):
            return original(*args, **kwargs)

    return forward


def _norm_forward(original, profile: RuntimeProfile, rms: bool):
    def forward(self, *args, **kwargs):
        mode = NormStats16(rms and profile.norm_stats_in_fp16(True), profile.norm_stats_in_fp16(False), profile.lanes)
        with mode:
            out = original(*args, **kwargs)
        if mode.rms and mode.means == 0:
            raise HalfsafeError(f"{type(self).__name__} computed its statistic without `.mean(-1)` of a square: the "
                                "float16 emulation cannot follow it (halfsafe.runtime.emulate)")
        return out

    return forward


def _linear_forward(profile: RuntimeProfile, split: int = 1, halves: bool = True):
    """`split` > 1: K cut into groups as `export onnx --runtime P` writes the product (arith16.split_matmul16)."""
    def product(x, w):
        groups = arith16.split_groups(w.shape[1], split)
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


def _attention_inputs(module, key, value, scaling):
    """One counted emulated attention call: its scale (the module's 1/sqrt(head_dim) when not given) and key and
    value repeated for each query head of their group (grouped-query attention)."""
    calls["attention"] += 1
    if scaling is None:
        scaling = module.head_dim ** -0.5
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return scaling, key, value


def attention16(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, lanes=64,
                chunk=32, **kwargs):
    """Eager attention (as transformers' eager_attention_forward), every step in float16."""
    scaling, key, value = _attention_inputs(module, key, value, scaling)
    b, h, q, d = query.shape
    qf, kf, vf = (arith16.r16(t.float()) for t in (query, key, value))
    logits = torch.stack([arith16.matmul16(qf[i, j], kf[i, j], chunk) for i in range(b) for j in range(h)])
    logits = arith16.r16(logits.reshape(b, h, q, -1) * arith16.scalar16(scaling))
    if softcap is not None:
        cap = arith16.scalar16(softcap)
        logits = arith16.r16(arith16.r16(torch.tanh(arith16.r16(logits / cap))) * cap)
    if attention_mask is not None:
        logits = arith16.r16(logits + arith16.r16(attention_mask[..., : key.shape[-2]].float()))
    probs = arith16.softmax16(logits, lanes)
    out = torch.stack([arith16.matmul16(probs[i, j], vf[i, j].t(), chunk) for i in range(b) for j in range(h)])
    out = out.reshape(b, h, q, value.shape[-1]).transpose(1, 2).contiguous().to(query.dtype)
    return out, probs.to(query.dtype)


def attention_webgpu16(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                       **kwargs):
    """Attention as ONNX Runtime WebGPU runs torch.onnx's decomposed SDPA, every step in float16: q and k each times
    sqrt(scale), QK^T and PV as float16 running sums of rounded products, the mask added, the online softmax
    (arith16_webgpu). A softcap (eager attention's) is applied as attention16 does, after an unsplit scale."""
    scaling, key, value = _attention_inputs(module, key, value, scaling)
    q, k, v = (arith16.r16(t.float()) for t in (query, key, value))
    if softcap is None:
        root = arith16.scalar16(math.sqrt(scaling))
        logits = arith16.sequential_matmul16(arith16.r16(q * root), arith16.r16(k * root))
    else:
        cap = arith16.scalar16(softcap)
        logits = arith16.r16(arith16.sequential_matmul16(q, k) * arith16.scalar16(scaling))
        logits = arith16.r16(arith16.r16(torch.tanh(arith16.r16(logits / cap))) * cap)
    if attention_mask is not None:
        logits = arith16.r16(logits + arith16.r16(attention_mask[..., : key.shape[-2]].float()))
    probs = arith16_webgpu.softmax16(logits)
    out = arith16.sequential_matmul16(probs, v.transpose(-1, -2))
    return out.transpose(1, 2).contiguous().to(query.dtype), probs.to(query.dtype)


ATTENTION = {"generic": (ATTENTION_NAME, attention16), "ort-webgpu": (WEBGPU_ATTENTION_NAME, attention_webgpu16)}


def _register_attention(kernels: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    name, function = ATTENTION[kernels]
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def is_activation(m: nn.Module) -> bool:
    """An activation module: transformers' (ACT2FN's classes) or torch's SiLU, GELU, Tanh, Sigmoid."""
    return isinstance(m, (nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid)) or type(m).__module__ == "transformers.activations"


SCALAR_OPS = {"mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "div",
              "__truediv__", "__rtruediv__"}


FUSED_ACTIVATIONS = {"NewGELUActivation": arith16_webgpu.gelu_tanh16}  # ONNX Runtime's FastGeluFusion: FastGelu


class GraphActivation(TorchFunctionMode):
    """Inside one activation module's forward under kernels="ort-webgpu", its float16 ops as the exported graph's
    run there: F.gelu(approximate="tanh") as the Gelu shader, F.silu as QuickGelu (ONNX Runtime fuses the exported
    Sigmoid and Mul into it), torch.sigmoid, torch.tanh and torch.pow by a constant as arith16_webgpu computes them,
    and Python numbers float16 constants (the graph stores them so: PyTorch would multiply by the float32 number).
    F.gelu without approximation (erf) stays PyTorch's: the shader's erf polynomial is not emulated."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.float16):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func is F.gelu and kwargs.get("approximate", args[1] if len(args) > 1 else "none") == "tanh":
            return arith16_webgpu.gelu_tanh16(x).to(x.dtype)
        if func is F.silu:
            return arith16_webgpu.quick_gelu16(x).to(x.dtype)
        if name == "sigmoid":
            return arith16_webgpu.sigmoid16(x).to(x.dtype)
        if name == "tanh":
            return arith16_webgpu.tanh16(x).to(x.dtype)
        if name in ("pow", "__pow__") and len(args) > 1 and isinstance(args[1], (int, float)):
            return arith16_webgpu.pow16(x, float(args[1])).to(x.dtype)
        if name in SCALAR_OPS:
            args = tuple(arith16.scalar16(a) if isinstance(a, float) else a for a in args)
        return func(*args, **kwargs)


def _activation_forward(original):
    def forward(self, *args, **kwargs):
        calls["activation"] += 1
        fused = FUSED_ACTIVATIONS.get(type(self).__name__)
        x = args[0] if args else None
        if fused is not None and isinstance(x, torch.Tensor) and x.dtype == torch.float16:
            return fused(x).to(x.dtype)
        with GraphActivation():
            return original(*args, **kwargs)

    return forward


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
            name = _register_attention(profile.attention_kernels)
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
            return _norm_forward(type(m).forward.__get__(m), profile, rms)
        if arith == GRAPH_KERNELS:
            return _graph_norm_forward(type(m).forward.__get__(m), profile)
        return None
    if profile.accumulates_fp16 and is_linear(m):
        # the export splits the K of MatMuls with a weight (not GPT-2's Conv1D, a Gemm); the head's partials
        # are added as neighbours, the others' as halves (halfsafe.export.onnx_split_k)
        kind = "head" if m is head else "linear" if isinstance(m, nn.Linear) else "conv1d"
        return _linear_forward(profile, profile.linear_split(kind), halves=m is not head)
    if profile.graph_activations and is_activation(m):
        return _activation_forward(type(m).forward.__get__(m))
    return None
