"""Activation statistics through forward hooks that the collector owns and removes.

A *site* (`sites.Site`) is one tensor the model computes: a module's output ("name:out") or, for leaf modules,
the first input ("name:in", e.g. the gated product a down projection reads, or the residual a norm reads).
Fused mixture-of-experts modules (transformers' `use_experts_implementation`: `gate_up_proj` [E, ...]
and `_apply_gate`) run every expert inside one forward, so each expert's gated product, what its down
projection reads, is recomputed from the module's input and recorded as "name:expert<e>".

Every collector of activations builds on `SiteCollector`: it owns the hooks (one `sites.Hooks`, taken off however
the block ends), names what it sees by `Site`, and hands each tensor to the collector's `record`. Collectors differ
only in what they keep: `ActivationCollector` every statistic of every site (the scan), the training's peak sampler
one scalar per watched site, verify's block peaks one float per block, the fine-tune's penalty a term that keeps
the graph, the runtime scan (runtime.stats) what a profile's float16 norms and linear layers compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .formats import FP16_MAX, FP16_MIN_NORMAL, all_finite
from .lanes import lane
from .sites import Hooks, Site, headroom_bits

PERCENTILE = 99.9
# values per chunk for the percentile and the underflow share: 2^14 gives the share within +-0.4% (two standard
# errors) and the 99.9th percentile from the top 17; each summary costs about 0.1 ms beside the chunk's one pass
_PERCENTILE_SAMPLE = 1 << 14
_CHUNK = 1 << 24


@dataclass
class SiteStats:
    name: str  # "module.path:out" or "module.path:in"
    module_class: str
    abs_max: float = 0.0
    percentile: float = 0.0  # PERCENTILE-th percentile of |x| (each chunk's, on its sample: `summarize_chunk`)
    above_fp16_max: int = 0
    # non-zero values fp16 stores only as subnormals (or flushes to 0), and non-zero values: counted in each chunk's
    # sample (`sampled` values; every value of a chunk under 2^14), for `underflow_fraction`
    below_fp16_min_normal: int = 0
    nonzero: int = 0
    sampled: int = 0
    numel: int = 0
    nonfinite: int = 0
    track_columns: bool = False  # keep `column_max` too (the probe tells a fused tensor's parts apart by it)
    column_max: torch.Tensor | None = None  # max |x| of each entry along the last dim, over everything else

    @property
    def module(self) -> str:
        return self.site.module

    @property
    def site(self) -> Site:
        return Site.parse(self.name)

    @property
    def headroom_bits(self) -> float:
        """log2(65504 / abs max): how many doublings fit before float16 overflows (negative: overflow)."""
        return headroom_bits(self.abs_max)

    @property
    def underflow_fraction(self) -> float:
        return self.below_fp16_min_normal / self.nonzero if self.nonzero else 0.0

    def update(self, x: torch.Tensor, summaries: "list[ChunkSummary] | None" = None) -> None:
        """Take `x` in; `summaries`: `chunk_summaries(x)` where the caller has them already (the same tensor seen at
        another site: what it adds is the same)."""
        for summary in chunk_summaries(x) if summaries is None else summaries:
            self.add(summary)
        if self.track_columns:
            self._update_columns(x.detach())

    def add(self, s: "ChunkSummary") -> None:
        """Take in one chunk's summary (`summarize_chunk`)."""
        if s.nonfinite:
            self.nonfinite += s.nonfinite
            self.abs_max = math.inf
            if s.numel == 0:
                return
        self.numel += s.numel
        self.abs_max = max(self.abs_max, s.abs_max)
        self.above_fp16_max += s.above_fp16_max
        self.nonzero += s.nonzero
        self.sampled += s.sampled
        self.below_fp16_min_normal += s.below_fp16_min_normal
        self.percentile = max(self.percentile, s.percentile)

    def _update_columns(self, x: torch.Tensor) -> None:
        cols = x.abs().reshape(-1, x.shape[-1] if x.dim() else 1).amax(0).float().cpu()
        if self.column_max is None:
            self.column_max = cols
        elif self.column_max.shape == cols.shape:
            self.column_max = torch.maximum(self.column_max, cols)
        else:  # calls of another width share this site: only the whole tensor's max is comparable
            self.column_max = torch.maximum(self.column_max.max(), cols.max()).reshape(1)


    def to_dict(self) -> dict:
        return {
            "name": self.module,
            "site": self.name,
            "class": self.module_class,
            "abs_max": self.abs_max,
            f"p{PERCENTILE:g}": self.percentile,
            "above_fp16_max": self.above_fp16_max,
            "underflow_fraction": self.underflow_fraction,
            "headroom_bits": self.headroom_bits,
            "nonfinite": self.nonfinite,
        }


@dataclass(frozen=True)
class ChunkSummary:
    """What one chunk of a tensor adds to a site's statistics (`SiteStats.add`)."""

    nonfinite: int = 0
    numel: int = 0  # finite entries
    abs_max: float = 0.0
    above_fp16_max: int = 0
    nonzero: int = 0  # in the sample (`sampled`)
    below_fp16_min_normal: int = 0  # in the sample
    percentile: float = 0.0  # of the sample
    sampled: int = 0


def summarize_chunk(x: torch.Tensor, width: int = 1) -> ChunkSummary:
    """One pass over `x` for what every value decides (its extremes, by `aminmax`: no |x| temporary); the rest from a
    sample of about 2^14 values (every value in a smaller chunk). `width`: the tensor's last dimension, which the
    sample's stride must not divide (a stride of 64 through rows of 1024 would see 16 columns, the same ones each
    row: a massive-activation channel in every sample)."""
    if not x.numel():
        return ChunkSummary()
    lo, hi = torch.aminmax(x)
    amax = max(-float(lo), float(hi))  # aminmax carries NaN and inf: the finite path below sees neither
    if not math.isfinite(amax):
        return _summarize_nonfinite(x, width)
    above = int(torch.count_nonzero(x.abs() > FP16_MAX)) if amax > FP16_MAX else 0
    sample = x[::sample_stride(x.numel(), width)].abs().float()
    return _from_sample(0, x.numel(), amax, above, sample)


def _summarize_nonfinite(x: torch.Tensor, width: int) -> ChunkSummary:
    finite = torch.isfinite(x)
    a = x[finite].abs()
    nonfinite = x.numel() - a.numel()
    if not a.numel():
        return ChunkSummary(nonfinite)
    amax = float(a.max())
    above = int(torch.count_nonzero(a > FP16_MAX)) if amax > FP16_MAX else 0
    return _from_sample(nonfinite, a.numel(), amax, above, a[::sample_stride(a.numel(), width)].float())


def _from_sample(nonfinite: int, numel: int, amax: float, above: int, sample: torch.Tensor) -> ChunkSummary:
    zeros = sample.numel() - int(torch.count_nonzero(sample))
    below = int(torch.count_nonzero(sample < FP16_MIN_NORMAL)) - zeros
    k = max(1, math.ceil(sample.numel() * PERCENTILE / 100))
    # the k-th smallest is the (n - k + 1)-th largest: the same value as kthvalue(k), from a top-17 of 16384 (faster)
    kth = float(sample.topk(sample.numel() - k + 1).values[-1])
    return ChunkSummary(nonfinite, numel, amax, above, sample.numel() - zeros, below, kth, sample.numel())


def sample_stride(numel: int, width: int) -> int:
    """1 up to 2^14 values; above, the least prime >= numel / 2^14 that does not divide `width` (so the sample walks
    through every column of a [rows, width] tensor instead of a few)."""
    target = numel // _PERCENTILE_SAMPLE
    if target <= 1:
        return 1
    p = target
    while not (_is_prime(p) and width % p):
        p += 1
    return p


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def chunk_summaries(x: torch.Tensor) -> list[ChunkSummary]:
    """`x`'s summaries, a chunk at a time, so a [seq, vocab] logits tensor needs no full-size temporaries."""
    width = x.shape[-1] if x.dim() else 1
    return [summarize_chunk(chunk, width) for chunk in x.detach().flatten().split(_CHUNK)]


class SeenTensors:
    """The summaries of the last few tensors recorded (`chunk_summaries`), by the tensor itself and its version: one
    tensor recorded at several sites (a norm's output at the norm and at each projection reading it, a module's
    output at its parent's, a block's output at the next norm's input) is summarised once. Each entry holds its
    tensor, so no other tensor can take its place while the entry lives; a tensor changed in place has another
    version and is summarised again."""

    def __init__(self, size: int = 3) -> None:  # 3: a Llama MLP's input, seen again after gate's output and act's
        self.size = size
        self._recent: list[tuple[torch.Tensor, int, list[ChunkSummary]]] = []

    def summaries(self, t: torch.Tensor) -> list[ChunkSummary]:
        for seen, version, out in self._recent:
            if seen is t and version == t._version:
                return out
        out = chunk_summaries(t)
        if self.size:
            self._recent = [(t, t._version, out), *self._recent[:self.size - 1]]
        return out

    def clear(self) -> None:
        self._recent = []


def first_tensor(value) -> torch.Tensor | None:
    """The first floating tensor in a module's input/output (tensors, tuples, model outputs)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            t = first_tensor(v)
            if t is not None:
                return t
    return None


@dataclass(eq=False)
class SiteCollector:
    """Forward hooks whose tensors go to `record(site, module, t)`: `t` is the first floating tensor (`first_tensor`)
    of a leaf's input ("name:in") or of a module's output ("name:out"). `watch` hooks one chosen site, every call of
    its module recorded under that one name; `ActivationCollector` hooks every module itself. `remove()`, or leaving
    the `with` block, takes every hook off; removing twice is harmless."""

    model: nn.Module
    _handles: Hooks = field(default_factory=Hooks, init=False, repr=False)

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        raise NotImplementedError

    def watch(self, site: "str | Site", name: str | None = None) -> None:
        """Hook `site` (an "in" or "out" site of a module the model has); `record` gets it as `name` (default: the
        site itself). An expert's product is computed inside its fused module, where no hook sees it."""
        where = Site.parse(site)
        module = self.model.get_submodule(where.module)
        name = str(where) if name is None else name
        if where.kind == "in":
            self._handles.add_pre(module, lambda mod, args: self._take(name, module, args))
        elif where.kind == "out":
            self._handles.add_post(module, lambda mod, args, out: self._take(name, module, out))
        else:
            raise ValueError(f"{where}: no hook sees an expert's product inside its fused module; watch "
                             f"'{where.module}:out' or measure it with ActivationCollector")

    def watch_all(self, sites: "Iterable[str | Site]") -> None:
        try:
            for site in sites:
                self.watch(site)
        except BaseException:
            self.remove()
            raise

    def _take(self, site: str, module: nn.Module, value) -> None:
        t = first_tensor(value)
        if t is not None:
            self.record(site, module, t)

    def remove(self) -> None:
        self._handles.remove()

    def __enter__(self) -> "SiteCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass
class ActivationCollector(SiteCollector):
    """`with ActivationCollector(model) as c: model(...)` fills `c.sites` in execution order.

    `stop_at_nonfinite=True` records only the first module whose output is non-finite
    (`c.first_nonfinite`), which is how the fp16 check names where a model breaks.
    A module called again inside one run of the module around it records each call as its own site
    ("name:out@2", see `sites`); calls made from outside every hooked module (the LM head run on chunks of
    positions) are one site. Forwards run in step (engine.pipeline) keep their own stack of running modules and
    first non-finite site, and `sites` ends in the order one forward after another gives.
    """

    stop_at_nonfinite: bool = False
    columns: bool = False  # each site's `column_max` too
    sites: dict[str, SiteStats] = field(default_factory=dict)
    first_nonfinite: str | None = None
    # per forward (core.lanes.lane(): None outside a pass), one [name, calls inside it, its own call] frame per
    # module now running, outermost first
    _stacks: dict = field(default_factory=dict)
    _order: dict = field(default_factory=dict)  # per forward, its sites in the order it first recorded them
    _nonfinite: dict = field(default_factory=dict)  # per forward, its first non-finite site
    _seen: SeenTensors = field(default_factory=SeenTensors)  # one tensor at several sites is summarised once
    unrecorded: set = field(default_factory=set)  # forwards (lanes) whose activations are not recorded: `unrecorded_run`

    @property
    def _running(self) -> list:
        return self._stacks.setdefault(lane(), [])

    def __enter__(self) -> "ActivationCollector":
        try:
            for name, module in self.model.named_modules():
                measured = bool(name)  # the model itself: its output is the logits, measured as the head's output
                is_leaf = next(module.children(), None) is None
                self._handles.add_pre(module, self._pre_hook(name, module, measured and is_leaf))
                self._handles.add_post(module, self._hook(name, module, measured), with_kwargs=True, always_call=True)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
        self._stacks.clear()
        self._seen.clear()
        if len(self._order) > 1:  # forwards in step: each one's sites in turn, as when they run one after another
            order = dict.fromkeys(s for k in sorted(self._order, key=_lane_order) for s in self._order[k])
            self.sites = {s: self.sites[s] for s in order}

    def unrecorded_run(self, run):
        """`run` (a zero-argument forward) wrapped so that what it computes is not recorded, whether it runs alone or in
        step with the recorded forwards (its lane is set aside while it runs)."""
        def wrapped():
            here = lane()
            self.unrecorded.add(here)
            try:
                return run()
            finally:
                self.unrecorded.discard(here)
        return wrapped

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        if lane() in self.unrecorded:
            return
        if self.stop_at_nonfinite:
            if lane() not in self._nonfinite and Site.parse(site).kind == "out" and not all_finite(t):
                self._nonfinite[lane()] = site
                self.first_nonfinite = self._nonfinite[min(self._nonfinite, key=_lane_order)]
            return
        self._order.setdefault(lane(), {})[site] = None
        stats = self.sites.get(site)
        if stats is None:
            stats = self.sites[site] = SiteStats(site, type(module).__name__, track_columns=self.columns)
        stats.update(t, self._seen.summaries(t))

    def _enter_call(self, name: str) -> int:
        """Push a frame for `name`; its call number inside the module that runs around it."""
        call = 1
        if self._running:
            calls = self._running[-1][1]
            call = calls[name] = calls.get(name, 0) + 1
        self._running.append([name, {}, call])
        return call

    def _pre_hook(self, name: str, module: nn.Module, measure_input: bool):
        site = Site(name, "in")

        def hook(mod, args):
            call = self._enter_call(name)
            if measure_input:
                self._take(str(site.at_call(call)), module, args)

        return hook

    def _hook(self, name: str, module: nn.Module, measured: bool):
        site, experts = Site(name, "out"), is_fused_experts(module)

        def hook(mod, args, kwargs, output):
            if not self._running or self._running[-1][0] != name:  # a hook added while this module was running
                return
            call = self._running.pop()[2]
            if not measured or output is None:
                return
            self._take(str(site.at_call(call)), module, output)
            if experts and not self.stop_at_nonfinite and lane() not in self.unrecorded:
                for e, parts in expert_products(mod, args, kwargs):
                    for part, t in parts.items():
                        self._take(str(Site.of_expert(name, e, part).at_call(call)), module, t)

        return hook


def _lane_order(lane: int | None) -> int:
    return -1 if lane is None else lane


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module: 3D `gate_up_proj` [E, ...] and the gate its forward applies."""
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, torch.Tensor) and w.dim() == 3 and hasattr(module, "_apply_gate") and hasattr(module, "is_transposed")


class FusedExperts(Protocol):
    """What `expert_products` reads of a module `is_fused_experts` accepted (the rest it reads with defaults)."""

    gate_up_proj: torch.Tensor
    is_transposed: bool

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor: ...


@torch.no_grad()
def expert_products(module: FusedExperts, args: tuple, kwargs: dict):
    """(e, {"": gated product, "gate": gate pre-activation, "up": up pre-activation}) for every expert some
    token was routed to, as the module's own forward computes them: forward(hidden_states [T, H], top-k
    expert indices [T, k], routing weights); gate and up concatenated ([gate; up]) or interleaved."""
    names = ("hidden_states", "top_k_index", "router_indices")
    given = list(args) + [kwargs[n] for n in names if n in kwargs]
    if len(given) < 2:
        return
    x, index = given[0], given[1]
    w = module.gate_up_proj
    bias = getattr(module, "gate_up_proj_bias", None) if getattr(module, "has_bias", False) else None
    for e in index.unique().tolist():
        if not 0 <= e < w.shape[0]:
            continue  # the masked slot some implementations route to
        xs = x[(index == e).any(-1)]
        h = xs @ w[e] if module.is_transposed else F.linear(xs, w[e])
        if bias is not None:
            h = h + bias[e]
        parts = {"": module._apply_gate(h)}
        if not getattr(module, "has_gate", True):
            parts["up"] = h
        elif getattr(module, "is_concatenated", True):
            parts["gate"], parts["up"] = h.chunk(2, dim=-1)
        else:
            parts["gate"], parts["up"] = h[..., ::2], h[..., 1::2]
        yield e, parts
