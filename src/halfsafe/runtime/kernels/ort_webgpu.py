"""The float16 kernels of ONNX Runtime's WebGPU provider (`kernels="ort-webgpu"`), as the exported graph runs
there (the shaders read and measured: halfsafe.runtime.profiles' docstring, core.arith16_webgpu):

- norms (GraphNorm): their statistic's mean in ReduceMean's order, in the square's own dtype; F.layer_norm of
  float16 as the fused LayerNormalization kernel;
- attention (attention_webgpu16): torch.onnx's decomposed SDPA, q and k each scaled by sqrt(scale), QK^T and PV as
  float16 running sums of rounded products, the online softmax;
- activation modules (GraphActivation): GELU (tanh), SiLU as QuickGelu, gelu_new as FastGelu, sigmoid, tanh, pow,
  after ONNX Runtime's own fusions, with Python numbers as the graph's float16 constants.
The linears' float16 running sum is the profile's data (`matmul_chunk=1`, `split_k`), emulated by runtime.emulate.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...core import arith16, arith16_webgpu
from ..profiles import RuntimeProfile, SplitK
from .common import attention_inputs, calls, layer_norm_args

NAME = "ort-webgpu"
ATTENTION_NAME = "halfsafe_ort_webgpu"


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
            x, weight, bias, eps = layer_norm_args(args, kwargs)
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


def graph_norm_forward(original, profile: RuntimeProfile):
    def forward(self, *args, **kwargs):
        with GraphNorm(profile.lanes):
            return original(*args, **kwargs)

    return forward


def _qk16(q: torch.Tensor, k: torch.Tensor, groups: int) -> torch.Tensor:
    """QK^T as the runtime computes it: one float16 running sum over the head dimension, or, split-K (`groups`, a
    power of two dividing it, as halfsafe.export.onnx_split_k cuts it), a running sum per consecutive run added
    pairwise by halves."""
    d, g = q.shape[-1], groups
    bounds = [d * i // g for i in range(g + 1)]
    parts = [arith16.sequential_matmul16(q[..., a:b], k[..., a:b]) for a, b in zip(bounds, bounds[1:])]
    while len(parts) > 1:
        h = len(parts) // 2
        parts = [arith16.r16(x + y) for x, y in zip(parts[:h], parts[h:])]
    return parts[0]


def attention_webgpu16(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                       split: SplitK | None = None, **kwargs):
    """Attention as ONNX Runtime WebGPU runs torch.onnx's decomposed SDPA, every step in float16: q and k each times
    sqrt(scale), QK^T (its head dimension in the groups `split` gives it, as the export splits it) and PV as float16
    running sums of rounded products, the mask added, the online softmax (arith16_webgpu). A softcap (eager
    attention's) is applied as attention16 does, after an unsplit scale."""
    groups = split.groups_for("attention", query.shape[-1]) if split is not None else 1
    scaling, key, value = attention_inputs(module, key, value, scaling)
    q, k, v = (arith16.r16(t.float()) for t in (query, key, value))
    if softcap is None:
        root = arith16.scalar16(math.sqrt(scaling))
        logits = _qk16(arith16.r16(q * root), arith16.r16(k * root), groups)
    else:
        cap = arith16.scalar16(softcap)
        logits = arith16.r16(_qk16(q, k, groups) * arith16.scalar16(scaling))
        logits = arith16.r16(arith16.r16(torch.tanh(arith16.r16(logits / cap))) * cap)
    if attention_mask is not None:
        logits = arith16.r16(logits + arith16.r16(attention_mask[..., : key.shape[-2]].float()))
    probs = arith16_webgpu.softmax16(logits)
    out = arith16.sequential_matmul16(probs, v.transpose(-1, -2))
    return out.transpose(1, 2).contiguous().to(query.dtype), probs.to(query.dtype)


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


def activation_forward(original):
    def forward(self, *args, **kwargs):
        calls["activation"] += 1
        fused = FUSED_ACTIVATIONS.get(type(self).__name__)
        x = args[0] if args else None
        if fused is not None and isinstance(x, torch.Tensor) and x.dtype == torch.float16:
            return fused(x).to(x.dtype)
        with GraphActivation():
            return original(*args, **kwargs)

    return forward


def attention(profile: RuntimeProfile):
    """(registered name, function): attention_webgpu16 with QK^T split as the profile's export splits it."""
    split = profile.split_k
    if not split.splits:
        return ATTENTION_NAME, attention_webgpu16
    label = f"t{split.bound('attention')}" if split.terms is not None else "qk" + "_".join(map(str, split.groups))
    return f"{ATTENTION_NAME}_{label}", functools.partial(attention_webgpu16, split=split)
