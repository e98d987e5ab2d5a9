"""The float16 kernels of the generic profiles (`kernels="generic"`: fp16-norm-stats, layernorm-decomposed,
fp16-accumulate, all-fp16): arith16's own ops, as an on-device engine or a decomposed fp16 graph computes them.

- norms whose statistic the profile puts in float16 (RuntimeProfile.norm_arith == FP16_STATS, whichever kernels it
  names): the statistic chain the modeling code writes (`x.pow(2)` / `x.square()`, `.mean(-1)`, `+ eps`,
  `torch.rsqrt` / `torch.pow(., -0.5)`) in float16, the rest as written (NormStats16); F.layer_norm as
  arith16.layer_norm16, decomposed in float16;
- attention: QK^T and PV as the linears accumulate, the scale, softcap, mask and softmax in float16 (attention16).
Activation modules and the graph's own norms: PyTorch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...core import arith16
from ...errors import HalfsafeError
from ..profiles import GENERIC, RuntimeProfile
from .common import attention_inputs, calls, layer_norm_args

NAME = GENERIC
ATTENTION_NAME = "halfsafe_fp16"


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
            x, weight, bias, eps = layer_norm_args(args, kwargs)
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


def fp16_stats_norm_forward(original, profile: RuntimeProfile, rms: bool):
    def forward(self, *args, **kwargs):
        mode = NormStats16(rms and profile.norm_stats_in_fp16(True), profile.norm_stats_in_fp16(False), profile.lanes)
        with mode:
            out = original(*args, **kwargs)
        if mode.rms and mode.means == 0:
            raise HalfsafeError(f"{type(self).__name__} computed its statistic without `.mean(-1)` of a square: the "
                                "float16 emulation cannot follow it (halfsafe.runtime.emulate)")
        return out

    return forward


def attention16(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, lanes=64,
                chunk=32, **kwargs):
    """Eager attention (as transformers' eager_attention_forward), every step in float16."""
    scaling, key, value = attention_inputs(module, key, value, scaling)
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


def graph_norm_forward(original, profile: RuntimeProfile):
    """No graph norm kernels of its own: the norms keep PyTorch's arithmetic unless their statistic is float16."""
    return None


def activation_forward(original):
    """No activation kernels of its own: activation modules keep PyTorch's arithmetic."""
    return None


def attention(profile: RuntimeProfile):
    """(registered name, function): attention16 (the profiles' runs of 32 products; no split-K of QK^T)."""
    return ATTENTION_NAME, attention16
