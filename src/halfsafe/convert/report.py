"""What a conversion gives back: each candidate plan as measured, and the `ConversionReport` (halfsafe.json keeps its
saved part: io/report.py's `Conversion`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..core.margin import Margin
from ..core.plan import Plan
from ..engine.reads import Reads
from ..io.report import Conversion, Record
from ..scan import ScanReport


@dataclass
class Candidate:
    exponents: dict[str, int]
    kl: float  # mean KL(fp32 original || fp16 rescaled) per token on the evaluation prefix
    top1: float
    finite: bool
    headroom_bits: float = math.nan  # bits under 65504 left on the tightest movable peak (calibration)
    keeps_margin: bool = True  # only candidates that keep the margin are run and may be chosen

    @property
    def residual_exponent(self) -> int:
        return self.exponents.get("residual", 0)


@dataclass
class ConversionReport:
    plan: Plan
    scan_before: ScanReport
    layers_after: list[tuple[str, float]]  # predicted residual peak per block after the plan
    unfixable: list[tuple[str, float]]  # (site, predicted |x| max) still above 65504
    tight: list[tuple[str, float]]  # under 65504 but above the headroom target
    candidates: list[Candidate]
    storage: list[dict]  # per touched tensor: fp16 storage error before/after
    fp32_output_change: float  # relative max change of fp32 logits (exactness, should be ~1e-7)
    fp16_finite: bool
    notes: list[str] = field(default_factory=list)
    margin: Margin | None = None
    runtime: dict | None = None  # convert --runtime: the profile, its constraints and candidates (runtime_convert)
    phases: list[dict] = field(default_factory=list)  # convert_checkpoint: {"name", "wall_s", "cpu_s"} per phase (halfsafe.progress)
    reads: Reads = field(default_factory=Reads)  # passes over a streamed model's checkpoint per phase
    reference_logits: torch.Tensor | None = field(default=None, repr=False)  # fp32, on the evaluation prefix (reused)
    fp16_arith: dict | None = None  # how the candidates' float16 ran (halfsafe.engine.fp16_arith.resolve)
    calib_arith: dict | None = None  # how the calibration multiplied (halfsafe.engine.calib_arith.resolve); None: scan given

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if self.is_chosen(c))

    def is_chosen(self, c: Candidate) -> bool:
        return {k: v for k, v in c.exponents.items() if v} == self.plan.exponents

    def saved(self) -> Conversion:
        """What halfsafe.json keeps of this report (io.report): everything but timings and the reference logits."""
        return Conversion(
            plan=self.plan, margin=self.margin,
            peaks_before={l.name: l.residual_peak for l in self.scan_before.layers},
            peaks_after=dict(self.layers_after),
            peak_before=self.scan_before.peak.abs_max,
            unfixable=[{"site": s, "abs_max": v} for s, v in self.unfixable],
            below_headroom_target=[{"site": s, "abs_max": v} for s, v in self.tight],
            candidates=[vars(c) for c in self.candidates],
            tensor_storage=self.storage,
            fp32_output_change=self.fp32_output_change,
            fp16_finite_on_calibration=self.fp16_finite,
            notes=self.notes,
            runtime=self.runtime,
            checkpoint_reads=self.reads.to_dict() if self.reads else None,
            fp16_arith=self.fp16_arith,
            calib_arith=self.calib_arith,
        )

    def record(self, source: str) -> Record:
        """halfsafe.json of a conversion of `source`."""
        return Record(source, self.saved())

    def to_dict(self) -> dict:
        return self.saved().to_dict()
