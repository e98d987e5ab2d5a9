"""`scan`: run calibration text through a model and say where, and by how much, it would overflow float16.

Top level: a verb of its own (`halfsafe scan`) and step 2 of convert/; verify/, export/ and training/ use it too.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel

from .calibration import fit_positions, make_samples, read_texts
from .core.formats import FP16_MAX
from .core.forward import model_inputs, prefix, run_for_stats
from .core.sites import Site, block_of, find_blocks, headroom_bits
from .core.stats import ActivationCollector, SiteStats
from .engine.calib_arith import calib_arith
from .engine.calib_arith import resolve as resolve_calib
from .engine.fp16_arith import resolve
from .engine.pipeline import in_step
from .engine.precision import in_dtype
from .engine.shared_head import SharedHead
from .io import loading  # loading.load_model: read when called, where the tests replace it
from .progress import phase
from .requests import ScanOptions, ScanRequest
from .runtime.profiles import RuntimeProfile
from .runtime.stats import RuntimeCollector, RuntimeScan

FP16_CHECK_TOKENS = 128  # fp16 matmuls are slow on CPUs; the first overflow shows within a short prefix


@dataclass
class LayerPeak:
    name: str
    residual_peak: float  # abs max of the block's output: the residual stream after this layer
    inner_peak: float  # abs max over every tensor measured inside the block
    inner_site: str

    @property
    def headroom_bits(self) -> float:
        return headroom_bits(self.residual_peak)


@dataclass
class ScanReport:
    model: str
    model_type: str
    n_samples: int
    n_tokens: int
    sites: dict[str, SiteStats]
    layers: list[LayerPeak]
    first_nonfinite_fp16: str | None = None
    fp16_checked: bool = False
    notes: list[str] = field(default_factory=list)
    runtime: "RuntimeScan | None" = None  # what a runtime profile puts in float16 (scan --runtime)
    fp16_arith: dict | None = None  # how the fp16 check computed (halfsafe.engine.fp16_arith.resolve)

    @property
    def fp16_safe(self) -> bool:
        return all(s.abs_max <= FP16_MAX for s in self.sites.values())

    @property
    def peak(self) -> SiteStats:
        return max(self.sites.values(), key=lambda s: s.abs_max)

    def modules(self) -> list[SiteStats]:
        """Module outputs, in execution order."""
        return [s for s in self.sites.values() if s.site.kind == "out"]

    def worst(self, n: int = 10) -> list[SiteStats]:
        return sorted(self.sites.values(), key=lambda s: s.headroom_bits)[:n]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "model_type": self.model_type,
            "fp16_safe": self.fp16_safe,
            "peak": self.peak.to_dict(),
            "n_samples": self.n_samples,
            "n_tokens": self.n_tokens,
            "fp16_check": {"ran": self.fp16_checked, "first_nonfinite_module": self.first_nonfinite_fp16,
                           **({"arith": self.fp16_arith} if self.fp16_arith is not None else {})},
            "layers": [
                {"name": l.name, "residual_peak": l.residual_peak, "headroom_bits": l.headroom_bits,
                 "inner_peak": l.inner_peak, "inner_site": l.inner_site}
                for l in self.layers
            ],
            "modules": [s.to_dict() for s in self.modules()],
            "inputs": [s.to_dict() for s in self.sites.values() if s.site.kind == "in"],
            "notes": self.notes,
            **({"runtime": self.runtime.to_dict()} if self.runtime is not None else {}),
        }


@torch.no_grad()
def collect(model: PreTrainedModel, samples: list[torch.Tensor], progress: bool = True, label: str = "scan",
            also=nullcontext(), beside: Sequence[Callable[[], object]] = ()) -> dict[str, SiteStats]:
    """Activation statistics of `model` over `samples`, merged across samples (`also`: another collector, entered
    for the same passes). The samples run in step (engine.pipeline): a streamed model's units are read once for all;
    not under `also` (a runtime profile's collector measures the first calls of each linear: the order counts).
    `beside`: more forwards (zero-argument callables, keeping their own results) run in the same pass, after the
    samples, their activations not recorded: convert's float32 reference logits cost no read of their own."""
    together = isinstance(also, nullcontext)
    if beside and not together:
        raise ValueError("forwards beside the samples run in step, which a runtime profile's collector does not allow")
    with ActivationCollector(model) as collector, also, phase(label, model, passes=len(samples) + len(beside),
                                                             quiet=not progress, pass_name=None if together else "sample"):
        # a wide head read once for every sample, after the pass (not under `also`: its hooks must see the head's calls)
        shared = SharedHead.of(model, samples, collector.record) if together else None
        runs = [partial(run_for_stats, model, ids, shared) for ids in samples] + [collector.unrecorded_run(r) for r in beside]
        if together:
            in_step(model, runs)
            if shared is not None:
                shared.run()
        else:
            for run in runs:
                run()
    return collector.sites


def layer_peaks(model: PreTrainedModel, sites: dict[str, SiteStats]) -> list[LayerPeak]:
    blocks = find_blocks(model)
    inner: dict[str, list[SiteStats]] = {b: [] for b in blocks}
    for s in sites.values():
        module = s.site.module
        block = block_of(module, blocks)
        if block is not None and module != block:  # inside the block, not the block's own input or output
            inner[block].append(s)
    peaks = []
    for block in blocks:
        out = sites.get(str(Site(block, "out")))
        if out is None:
            continue
        top = max(inner[block], key=lambda s: s.abs_max, default=out)
        peaks.append(LayerPeak(block, out.abs_max, max(top.abs_max, out.abs_max), top.name))
    return peaks


@dataclass
class Fp16Check:
    """What a float16 copy of a model computed on a short prefix of the first two samples (`check_fp16`)."""

    first_nonfinite: str | None  # the first module whose output is inf/NaN: the first sample's, else the second's
    sites: dict[str, SiteStats] | None  # every site's statistics (check_fp16(..., stats=True)), else None
    tokens: int

    @property
    def finite(self) -> bool:
        """No module output inf/NaN, nor (where measured) any other site."""
        return self.first_nonfinite is None and all(math.isfinite(s.abs_max) for s in (self.sites or {}).values())

    def summary(self) -> dict:
        """finite, the largest |x| and its site, tokens: what `halfsafe finetune` reports of its fp16 check."""
        if not self.sites:
            raise ValueError("no site was measured: run check_fp16(..., stats=True)")
        top = max(self.sites.values(), key=lambda s: s.abs_max)
        return {"finite": self.finite, "peak": top.abs_max, "peak_site": top.name, "tokens": self.tokens}


@torch.no_grad()
def check_fp16(model: PreTrainedModel, samples: list[torch.Tensor], arith: str = "native", stats: bool = False) -> Fp16Check:
    """The fp16 check: a float16 copy of `model` (`in_dtype`: a streamed model too, reductions exact; `arith`:
    halfsafe.engine.fp16_arith) on the first FP16_CHECK_TOKENS tokens of the first two samples. It names the first
    module whose output is inf/NaN; `stats` measures every site as well (then both samples always run)."""
    with in_dtype(model, torch.float16, arith) as half, ActivationCollector(half, stop_at_nonfinite=True) as first, \
            (ActivationCollector(half) if stats else nullcontext()) as measured:
        # the first sample's site if it has one, else the second's (one after another, the second only if needed)
        in_step(half, [partial(_fp16_forward, half, ids) for ids in samples[:2]],
                until=lambda: bool(first.first_nonfinite) and not stats)
    shown = [prefix(s, FP16_CHECK_TOKENS) for s in samples[:2]]
    tokens = sum((s["input_ids"] if isinstance(s, dict) else s).numel() for s in shown)
    return Fp16Check(first.first_nonfinite, measured.sites if stats else None, tokens)


def first_nonfinite_in_fp16(model: PreTrainedModel, samples: list[torch.Tensor], arith: str = "native") -> str | None:
    """The first module whose output is inf/NaN in the fp16 check (`check_fp16`), or None."""
    return check_fp16(model, samples, arith).first_nonfinite


def _fp16_forward(half: PreTrainedModel, ids) -> None:
    half(**model_inputs(half, prefix(ids, FP16_CHECK_TOKENS)), use_cache=False)


def scan(model: PreTrainedModel, samples: list[torch.Tensor], fp16_check: bool = False, progress: bool = True, name: str = "",
         runtime: "str | RuntimeProfile | None" = None, fp16_arith: str | None = None) -> ScanReport:
    """Measure every module's activations on `samples` (the model's own dtype, normally float32); `runtime`: also
    the quantities that runtime profile computes in float16 (halfsafe.runtime.stats; "torch": none). `fp16_arith`:
    how the fp16 check computes ("emulated", the default where proven, or "native": halfsafe.engine.fp16_arith).
    The options become one checked `ScanOptions` (halfsafe.requests): `scan_with`."""
    return scan_with(model, samples, ScanOptions.checked(fp16_check, runtime, fp16_arith), progress, name)


def scan_with(model: PreTrainedModel, samples: list[torch.Tensor], options: ScanOptions, progress: bool = True,
              name: str = "", beside: Sequence[Callable[[], object]] = ()) -> ScanReport:
    """`scan` for options already checked; `beside`: forwards run in the same pass, unrecorded (`collect`)."""
    profile = options.runtime
    extra = RuntimeCollector(model, profile) if not profile.is_torch else None
    used = resolve_calib(options.calib_arith, model)["used"]
    with calib_arith(used):  # the matrix products' arithmetic (float32, or bfloat16 operands where chosen)
        sites = collect(model, samples, progress, also=extra if extra is not None else nullcontext(), beside=beside)
    report = ScanReport(
        model=name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        model_type=model.config.model_type,
        n_samples=len(samples),
        n_tokens=sum((s["input_ids"] if isinstance(s, dict) else s).numel() for s in samples),
        sites=sites,
        layers=layer_peaks(model, sites),
        runtime=extra.scan if extra is not None else None,
    )
    if options.fp16_check:
        report.fp16_arith = resolve(options.fp16.fp16_arith, model)
        with phase("fp16 check", model, passes=min(len(samples), 2), quiet=not progress):
            report.first_nonfinite_fp16 = first_nonfinite_in_fp16(model, samples, report.fp16_arith["used"])
        report.fp16_checked = True
    return report


def run_scan(request: ScanRequest) -> ScanReport:
    """`halfsafe scan`: the request's model loaded, its samples cut, scanned."""
    text = request.text
    loaded = loading.load_model(request.model, stream=request.engine.stream, device=request.engine.device,
                                **({"tokenizer": text.tokenizer} if text.tokenizer else {}))
    seq_len = fit_positions(loaded.model, text.seq_len, lambda said: print(f"note: {said}", file=sys.stderr))
    samples = make_samples(text.text_list or read_texts(None), loaded.tokenizer,
                           loaded.model.config.get_text_config().vocab_size, seq_len, text.max_samples)
    return scan_with(loaded.model, samples, request.options, request.progress, name=str(request.model))
