"""`scan --runtime P`: the quantities a runtime profile puts in float16, measured on the float32 run.

Per norm (the ones the profile computes in float16): the largest |x| it reads, the largest sum and mean of squares
of a row (RMSNorm: x^2; decomposed LayerNorm: (x - mean)^2, and its largest |x - mean|), how many rows' sums pass
65504 (then the statistic is inf and the row comes out 0), the smallest non-zero mean of squares and how many rows'
means round to 0 in float16, and whether the norm's eps itself rounds to 0. Per linear layer (profiles that
accumulate in float16): the largest partial sum at the profile's chunking (the running sum over runs of
`matmul_chunk` products) and the largest output, on the first PARTIAL_TOKENS positions of its first PARTIAL_CALLS
forward passes: each costs a matrix product's work again (Gemma 3's head: 262k rows), and the positions that peak
(a BOS token's massive activations) come first. Headroom is log2(65504 / largest), as everywhere in halfsafe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core import arith16
from ..core.formats import FP16_MAX
from ..core.linears import is_linear, out_in_weight
from ..core.sites import Site, headroom_bits
from ..core.stats import SiteCollector
from ..engine.wide import WideWeight
from .emulate import is_rms_norm
from .profiles import RuntimeProfile

FP16_ROUNDS_TO_ZERO = 2.0 ** -25  # half of float16's smallest subnormal: anything below rounds to 0
PARTIAL_TOKENS = 128
PARTIAL_CALLS = 2
SEGMENT_RUNS = 8  # running sums held at once per output: a buffer that stays in cache (measured on Gemma 3's head)


@dataclass
class NormStats:
    name: str
    module_class: str
    kind: str  # "rms" or "layernorm"
    eps: float
    abs_max: float = 0.0  # largest |x| read
    dev_max: float = 0.0  # LayerNorm: largest |x - mean| (what Pow squares); RMSNorm: = abs_max
    sum_sq_max: float = 0.0
    mean_sq_max: float = 0.0
    mean_sq_min: float = math.inf  # smallest non-zero mean of squares
    rows: int = 0
    rows_sum_overflow: int = 0  # sum of squares > 65504: inf in float16
    rows_mean_zero: int = 0  # mean of squares rounds to 0 in float16 (0 + an eps that is 0 too: rsqrt(0) = inf)

    @property
    def eps_rounds_to_zero(self) -> bool:
        return self.eps > 0 and arith16.scalar16(self.eps) == 0.0

    @property
    def headroom_bits(self) -> float:
        return headroom_bits(self.sum_sq_max)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1, x.shape[-1])
        d = x - x.mean(-1, keepdim=True) if self.kind == "layernorm" else x
        sq = d * d
        sums = sq.sum(-1)
        means = sums / x.shape[-1]
        self.abs_max = max(self.abs_max, float(x.abs().max()))
        self.dev_max = max(self.dev_max, float(d.abs().max()))
        self.sum_sq_max = max(self.sum_sq_max, float(sums.max()))
        self.mean_sq_max = max(self.mean_sq_max, float(means.max()))
        nonzero = means[means > 0]
        if nonzero.numel():
            self.mean_sq_min = min(self.mean_sq_min, float(nonzero.min()))
        self.rows += x.shape[0]
        self.rows_sum_overflow += int((sums > FP16_MAX).sum())
        self.rows_mean_zero += int((means < FP16_ROUNDS_TO_ZERO).sum())

    def to_dict(self) -> dict:
        return {"name": self.name, "class": self.module_class, "kind": self.kind, "eps": self.eps,
                "eps_rounds_to_zero": self.eps_rounds_to_zero, "abs_max": self.abs_max, "dev_max": self.dev_max,
                "sum_sq_max": self.sum_sq_max, "mean_sq_max": self.mean_sq_max,
                "mean_sq_min": self.mean_sq_min if math.isfinite(self.mean_sq_min) else None, "rows": self.rows,
                "rows_sum_overflow": self.rows_sum_overflow, "rows_mean_zero": self.rows_mean_zero,
                "headroom_bits": self.headroom_bits}


@dataclass
class LinearStats:
    name: str
    module_class: str
    chunk: int
    partial_max: float = 0.0  # largest |running sum| over the runs of `chunk` products, the final one included
    out_max: float = 0.0
    rows: int = 0
    calls: int = 0

    @property
    def headroom_bits(self) -> float:
        return headroom_bits(self.partial_max)

    def update(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > PARTIAL_CALLS:
            return
        x2 = x.detach().float().reshape(-1, x.shape[-1])[:PARTIAL_TOKENS]
        self.rows += x2.shape[0]
        step = 4096
        for start in range(0, weight.shape[0], step):
            stop = min(start + step, weight.shape[0])
            w = weight.rows(start, stop) if isinstance(weight, WideWeight) else weight[start:stop]
            self._update_rows(x2, w.detach().float())

    def _update_rows(self, x2: torch.Tensor, w: torch.Tensor) -> None:
        """The running sums [runs, T, rows], SEGMENT_RUNS runs at a time into one buffer, each segment carrying on
        from the last one's end (a run of 1 product has K of them: Gemma 3's head would need 85 GB at once; a new
        tensor per segment spent most of the time mapping memory)."""
        t, k = x2.shape
        runs = -(-k // self.chunk)
        pad = runs * self.chunk - k
        xs = torch.nn.functional.pad(x2, (0, pad)).reshape(t, runs, self.chunk).transpose(0, 1)  # [runs, T, chunk]
        ws = torch.nn.functional.pad(w, (0, pad)).reshape(w.shape[0], runs, self.chunk).permute(1, 2, 0)  # [runs, chunk, rows]
        buf = torch.empty(min(SEGMENT_RUNS, runs), t, w.shape[0], device=x2.device)
        carry = torch.zeros(t, w.shape[0], device=x2.device)
        for start in range(0, runs, SEGMENT_RUNS):
            n = min(SEGMENT_RUNS, runs - start)
            running = buf[:n]
            torch.matmul(xs[start:start + n], ws[start:start + n], out=running)  # each run's dot product
            running.cumsum_(0)
            running.add_(carry)
            low, high = torch.aminmax(running)
            self.partial_max = max(self.partial_max, -float(low), float(high))
            carry = running[-1].clone()
        self.out_max = max(self.out_max, float(carry.abs().max()))

    def to_dict(self) -> dict:
        return {"name": self.name, "class": self.module_class, "chunk": self.chunk, "partial_max": self.partial_max,
                "out_max": self.out_max, "rows": self.rows, "headroom_bits": self.headroom_bits}


@dataclass
class RuntimeScan:
    profile: RuntimeProfile
    norms: dict[str, NormStats] = field(default_factory=dict)
    linears: dict[str, LinearStats] = field(default_factory=dict)

    def tightest(self, n: int = 10) -> list:
        return sorted([*self.norms.values(), *self.linears.values()], key=lambda s: s.headroom_bits)[:n]

    @property
    def fits(self) -> bool:
        """Every measured quantity under 65504, no mean that rounds to 0 against an eps that does too."""
        norms_ok = all(s.rows_sum_overflow == 0 and not (s.rows_mean_zero and s.eps_rounds_to_zero) for s in self.norms.values())
        return norms_ok and all(s.partial_max <= FP16_MAX for s in self.linears.values())

    def to_dict(self) -> dict:
        return {"profile": self.profile.to_dict(), "fits": self.fits,
                "norms": [s.to_dict() for s in self.norms.values()],
                "linears": [s.to_dict() for s in self.linears.values()]}


def _eps(m: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0


class RuntimeCollector(SiteCollector):
    """`with RuntimeCollector(model, profile) as c: model(...)` fills `c.scan`: the input of every norm and linear
    layer the profile computes in float16, watched as that module's "name:in" site (the hooks are SiteCollector's)."""

    def __init__(self, model: nn.Module, profile: RuntimeProfile) -> None:
        super().__init__(model)
        self.scan = RuntimeScan(profile)
        self._stats: dict[str, NormStats | LinearStats] = {}  # site -> what its tensors update

    def __enter__(self) -> "RuntimeCollector":
        p = self.scan.profile
        for name, m in self.model.named_modules():
            rms = is_rms_norm(m)
            if (rms or isinstance(m, nn.LayerNorm)) and p.norm_stats_in_fp16(rms):
                self._stats[str(Site(name, "in"))] = self.scan.norms[name] = NormStats(
                    name, type(m).__name__, "rms" if rms else "layernorm", _eps(m))
            elif p.accumulates_fp16 and is_linear(m):
                self._stats[str(Site(name, "in"))] = self.scan.linears[name] = LinearStats(name, type(m).__name__, p.matmul_chunk)
        self.watch_all(self._stats)
        return self

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        if not t.numel():
            return
        stats = self._stats[site]
        if isinstance(stats, LinearStats):
            stats.update(t, out_in_weight(module))
        else:
            stats.update(t)

    def __exit__(self, *exc) -> None:
        self.remove()
        # norms and linears that never ran (a tower the text did not reach) say nothing
        self.scan.norms = {k: v for k, v in self.scan.norms.items() if v.rows}
        self.scan.linears = {k: v for k, v in self.scan.linears.items() if v.rows}
