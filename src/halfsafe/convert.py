"""make_fp16_safe: scan, probe, plan, choose, apply, check. The Python API behind `halfsafe convert`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .calibration import default_text, long_sample_ids, make_samples
from .core.formats import all_finite
from .core.forward import logits as forward_logits
from .core.forward import prefix, sample_tokens
from .core.groups import expand
from .core.margin import Margin, choose_margin
from .core.metrics import mean_kl, top1_agreement
from .core.plan import (
    FP16_MAX_BITS,
    MIN_EXPONENT,
    Constraint,
    Plan,
    predicted_log2,
    site_constraints,
    solve,
    tensor_table,
    weight_constraints,
)
from .core.rewrite import apply_exponents_, model_key, trial
from .core.shrink import EXPERT_FIELDS, TOP_K_FIELDS, probe_governed
from .core.sites import Site
from .core.stats import is_fused_experts
from .core.weights import value_blocks, weights_of
from .engine.calib_arith import BFLOAT16, FLOAT32, PEAK_RTOL, float32_products
from .engine.calib_arith import resolve as resolve_calib
from .engine.device import return_freed_memory
from .engine.fp16_arith import resolve as resolve_arith
from .engine.precision import in_dtype
from .engine.reads import Reads
from .errors import HalfsafeError, UnfixableOverflowError
from .families import family_for
from .io.report import Applied, Conversion, Record, ScanAfter
from .job import Job, Options, Output, run
from .progress import phase, recorded
from .requests import (
    APPLY_TEXT,
    CANDIDATES,
    CONVERT_TEXT,
    DEFAULT_MAX_SHARD_SIZE,
    ApplyRequest,
    ConvertRequest,
    EngineOptions,
    Fp16Options,
    PlanOptions,
    ScanOptions,
    TextOptions,
)
from .runtime.choose import choose
from .runtime.profiles import RuntimeProfile
from .scan import ScanReport, scan, scan_with

log = logging.getLogger(__name__)
PROBE_TOKENS = 32
EVAL_TOKENS = 128  # fp16 forward passes on CPU are slow; candidates are ranked on this prefix
CANDIDATES_ABOVE = 2  # residual scales tried above the largest one that keeps the margin (see keeps_margin)


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


@torch.no_grad()
def evaluate_candidate(model, family, groups, exponents, ids, ref, arith: str = "native") -> Candidate:
    """Apply, run in fp16 on `ids` (`arith`: halfsafe.engine.fp16_arith), compare to the fp32 reference, undo (bit for bit)."""
    with trial(model, family, groups, exponents), in_dtype(model, torch.float16, arith) as half:
        out = forward_logits(half, ids)  # compared in fp16: the metrics widen a few positions at a time, exactly
    finite = all_finite(out)
    return Candidate(dict(exponents), mean_kl(ref, out) if finite else math.inf, top1_agreement(ref, out), finite)


def candidate_exponents(groups, constraints, headroom_bits, n: int, above: int = CANDIDATES_ABOVE) -> list[dict[str, int]]:
    """The plan with the largest exponents that keep the margin (`headroom_bits`), the residual scale up to
    `above` steps larger and n-1 steps smaller (other groups solved again for each): larger scales keep
    Gemma's (1+w) gains finer in fp16, smaller ones add headroom. `keeps_margin` says which may be chosen;
    the measured fp16 KL decides among those."""
    best = solve(groups, constraints, headroom_bits)
    out = [best]
    if "residual" in best:
        for d in [*range(above, 0, -1), *range(-1, -n, -1)]:
            r = best["residual"] + d
            if not MIN_EXPONENT <= r <= 0:
                continue  # never scale up, nor below what a plan may hold
            cand = solve(groups, constraints, headroom_bits, fixed={"residual": r})
            if cand not in out:
                out.append(cand)
    return sorted(out, key=lambda e: -e.get("residual", 0))


def keeps_margin(constraints: list[Constraint], exps: dict[str, int], reference: dict[str, int], headroom_bits: float) -> tuple[bool, float]:
    """The margin rule: a candidate keeps the margin when every movable peak that the solver's plan
    (`reference`, solved for `headroom_bits`) keeps `headroom_bits` under 65504 stays there too, and no
    peak the solver could not bring there gets larger. Returns (kept, bits left on the tightest such peak)."""
    limit = FP16_MAX_BITS - headroom_bits
    kept, left = True, math.inf
    for c in constraints:
        if not c.powers:
            continue  # nothing moves it: reported as unfixable or tight, the same for every candidate
        p, ref = predicted_log2(c, exps), predicted_log2(c, reference)
        if ref <= limit + 1e-9:
            kept &= p <= limit + 1e-9
            left = min(left, FP16_MAX_BITS - p)
        else:
            kept &= p <= ref + 1e-9
    return kept, left


def choose_candidate(tried: list[Candidate]) -> Candidate:
    """The least fp16 KL among candidates that keep the margin and ran finite (ties: more headroom)."""
    valid = [c for c in tried if c.keeps_margin and c.finite] or [c for c in tried if c.keeps_margin] or tried
    return min(valid, key=lambda c: (c.kl, -c.headroom_bits))


def storage_error(t, chunk: int = 1 << 22) -> dict:
    """How far the fp16 copy of `t` (a tensor, or its blocks of rows) is from `t`: relative L2 error, non-zero entries
    whose copy is subnormal or zero, and finite entries whose copy is inf. In chunks, one float32 buffer reused: a
    168M-entry embedding needs no full-size temporaries. x - fp16(x) is exact in float32; the sums of squares are
    torch's float32 sums (cascaded: ~1e-7 relative; `vector_norm` is 1e-4 off here). The counts look at the copy's
    exponent bits, and only where a chunk's least exponent (or its peak) says there is something to count: about
    10 ns an entry less than comparing |x|."""
    err2 = ref2 = 0.0
    subnormal = overflow = 0
    blocks = [t] if isinstance(t, torch.Tensor) else t
    buf = None
    for x in (x for b in blocks for x in b.detach().flatten().split(chunk)):
        x = x.float()
        if buf is None or buf.numel() < x.numel():
            buf = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        h, d = x.half(), buf[:x.numel()]
        err2 += float(d.copy_(h).sub_(x).square_().sum())
        ref2 += float(d.copy_(x).square_().sum())
        exponent = h.view(torch.int16) & 0x7C00  # 0: subnormal or zero; 0x7C00: inf or NaN
        if int(exponent.min()) == 0:
            subnormal += int(torch.count_nonzero(x)) - int(torch.count_nonzero(exponent))
        if int(exponent.max()) == 0x7C00:
            overflow += int(torch.count_nonzero(h.isinf() & x.isfinite()))
    return {"fp16_rel_error": math.sqrt(err2 / ref2) if ref2 > 0 else 0.0, "subnormal_or_zero": subnormal, "overflow": overflow}


def _problems(constraints: list[Constraint], exps: dict[str, int], headroom_bits: float):
    unfixable, tight = [], []
    for c in constraints:
        p = predicted_log2(c, exps)
        if p > FP16_MAX_BITS:
            unfixable.append((c.site, 2.0 ** p))
        elif p > FP16_MAX_BITS - headroom_bits:
            tight.append((c.site, 2.0 ** p))
    return sorted(unfixable, key=lambda x: -x[1]), sorted(tight, key=lambda x: -x[1])


def default_samples(model: PreTrainedModel, tokenizer) -> list[torch.Tensor]:
    """The embedded calibration text as 8 samples of 512 tokens (the CLI's defaults)."""
    return make_samples([default_text()], tokenizer, model.config.get_text_config().vocab_size, 512, 8)


@torch.no_grad()
def plan_fp16_safe(
    model: PreTrainedModel,
    samples: list[torch.Tensor] | None = None,
    tokenizer=None,
    headroom_bits: float | None = None,
    allow_unfixable: bool = False,
    candidates: int = CANDIDATES,
    progress: bool = True,
    scan_report: ScanReport | None = None,
    max_context: int | None = None,
    runtime: str | RuntimeProfile | None = None,
    fp16_arith: str | None = None,
) -> ConversionReport:
    """Measure `model` (float32 weights) and choose a plan; the model is left as it was.
    `report.plan` is ready for `apply_plan_` (or `make_fp16_safe` does both). The margin kept under 65504
    is made for `max_context` tokens (default: the model's longest context) by `halfsafe.core.margin`'s rule;
    `headroom_bits` sets it instead. `runtime`: a runtime profile (halfsafe.runtime.profiles) other than "torch" chooses the
    plan under that profile's float16 arithmetic, or refuses (halfsafe.runtime.choose). `fp16_arith`: how the
    candidates' float16 computes ("emulated", the default where proven, or "native": halfsafe.engine.fp16_arith).
    The options become one checked `PlanOptions` (halfsafe.requests) before anything runs: `plan_with`."""
    options = PlanOptions.checked(headroom_bits, max_context, allow_unfixable, candidates, runtime, fp16_arith)
    if samples is None:
        samples = default_samples(model, tokenizer)
    return plan_with(model, samples, options, progress, scan_report)


@torch.no_grad()
def plan_with(model: PreTrainedModel, samples: list[torch.Tensor], options: PlanOptions, progress: bool = True,
              scan_report: ScanReport | None = None) -> ConversionReport:
    """`plan_fp16_safe` for options already checked."""
    profile = options.runtime
    arith = resolve_arith(options.fp16.fp16_arith, model)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    reads = Reads()
    calib = None if scan_report is not None else calibration_arith(options, model)
    eval_ids = _eval_ids(samples)
    logits_fp32: dict[str, torch.Tensor] = {}

    def reference_logits() -> None:  # the model as it is, in float32: what every candidate is compared with
        with float32_products():  # beside a bfloat16 calibration too: its products stay float32
            logits_fp32["reference"] = forward_logits(model, eval_ids).float()

    # beside the scan's samples, in the same pass, where convert calibrates with no runtime collector
    beside = [reference_logits] if calib is not None and profile.is_torch else []
    with reads.phase(model, "scan"):
        report = scan_report or scan_with(model, samples, ScanOptions(fp16=options.fp16, calib_arith=calib["used"]),
                                          progress, beside=beside)
    return_freed_memory()  # what the scan's forward passes freed, before the candidates' run
    margin = choose_margin(model.config, max(sample_tokens(s) for s in samples), options.margin.max_context,
                           options.margin.headroom_bits)
    headroom_bits = margin.bits
    candidates, allow_unfixable = options.candidates, options.allow_unfixable
    with reads.phase(model, "plan"):
        with phase("probe", quiet=not progress):
            governed = probe_governed(model, family, groups, prefix(samples[0], PROBE_TOKENS))  # on a shrunk random copy
        with phase("plan", quiet=not progress):
            weights = weight_constraints(groups, weights_of(model).values())
            constraints = site_constraints(report.sites, governed) + weights
    if calib is not None and calib["used"] == BFLOAT16 and not holds_within(groups, constraints, headroom_bits, candidates):
        # a decision sits within bfloat16's difference of its limit: the float32 peaks decide it, as they would alone
        calib["float32_again"] = (f"a peak sat within {PEAK_RTOL:g} of a limit the plan is chosen at: calibrated again "
                                  "in float32")
        with reads.phase(model, "scan"):  # the reference ran beside the bfloat16 calibration already
            report = scan_with(model, samples, ScanOptions(fp16=options.fp16, calib_arith=FLOAT32), progress)
        constraints = site_constraints(report.sites, governed) + weights
    if "reference" not in logits_fp32:
        with reads.phase(model, "reference"), phase("reference", model, quiet=not progress):
            reference_logits()
    ref = logits_fp32["reference"]
    reference = solve(groups, constraints, headroom_bits)
    tried, runtime_info = [], None
    with reads.phase(model, "candidates"):
        if profile.is_torch:
            tried = _evaluate_all(model, family, groups, constraints, reference, headroom_bits, candidates, eval_ids, ref,
                                  progress, arith["used"])
            chosen = choose_candidate(tried)
        else:
            chosen, tried, runtime_info = _choose_under(profile, model, family, groups, constraints, reference, headroom_bits,
                                                        candidates, eval_ids, ref, report, samples, progress)
    unfixable, tight = _problems(constraints, chosen.exponents, headroom_bits)
    if not chosen.finite and not unfixable and not allow_unfixable:
        # every measured tensor fits, yet fp16 overflows: inside a computation no module hook sees
        raise UnfixableOverflowError(
            f"every candidate plan still gives inf/NaN in float16 although each measured activation of {family.name} "
            f"fits; the overflow is inside an op no hook sees ({family.unfixable or 'see the family notes'}). "
            "Pass --allow-unfixable to convert anyway"
        )
    if unfixable and not allow_unfixable:
        worst = ", ".join(f"{s} ({v:.3g})" for s, v in unfixable[:3])
        raise UnfixableOverflowError(
            f"{len(unfixable)} tensor(s) would still exceed 65504 and no exact rescaling of {family.name} moves them: "
            f"{worst}; {family.unfixable or 'see the family notes'}. Pass --allow-unfixable to convert anyway"
        )
    return ConversionReport(
        plan=Plan.build(family.name, model.config.model_type, groups, chosen.exponents, headroom_bits, margin.context_length,
                        {n: tuple(p.shape) for n, p in model.named_parameters()}),
        scan_before=report,
        layers_after=_layers_after(report, constraints, chosen.exponents),
        unfixable=unfixable,
        tight=tight,
        candidates=tried,
        storage=[],
        fp32_output_change=math.nan,
        fp16_finite=chosen.finite,
        margin=margin,
        runtime=runtime_info,
        reads=reads,
        reference_logits=ref,
        fp16_arith=arith if profile.is_torch else None,
        calib_arith=calib,
    )


ROUTER_FIELDS = (*EXPERT_FIELDS, "moe_num_experts", *TOP_K_FIELDS)  # a config that counts or picks experts


def routes_tokens(model) -> bool:
    """A mixture of experts: fused experts (core.stats.is_fused_experts) or a config that counts experts."""
    config = model.config.get_text_config()
    return any(getattr(config, f, None) for f in ROUTER_FIELDS) or any(is_fused_experts(m) for m in model.modules())


def calibration_arith(options: PlanOptions, model) -> dict:
    """How the calibration multiplies (halfsafe.engine.calib_arith.resolve): float32 under a runtime profile other than
    torch, whose float16 quantities are measured on the calibration's own activations, and for a mixture of experts,
    whose router may send a token elsewhere on a rounding (an expert's peak then moves by more than any rounding
    bound: gemma4_text-moe's tiny model, 3.6%)."""
    if not options.runtime.is_torch:
        return {"asked": options.calib_arith, "used": FLOAT32,
                "why": f"--runtime {options.runtime.name}: its float16 quantities are measured on float32 activations"}
    if options.calib_arith != FLOAT32 and routes_tokens(model):
        return {"asked": options.calib_arith, "used": FLOAT32,
                "why": "per-expert peaks: a rounding may route a token to another expert"}
    return resolve_calib(options.calib_arith, model)


def _decisions(groups, constraints, headroom_bits, n) -> tuple:
    """Everything the plan's choice reads of the peaks: the solver's plan, the candidates, which keep the margin, and
    whether each that may be chosen (`choose_candidate`) leaves a site above 65504 (what convert refuses). Which sites
    halfsafe.json lists above 65504 or inside the margin, and their sizes, are the calibration's: not decisions."""
    reference = solve(groups, constraints, headroom_bits)
    tried = candidate_exponents(groups, constraints, headroom_bits, n)
    kept = [keeps_margin(constraints, e, reference, headroom_bits)[0] for e in tried]
    return (reference, tried, kept, [bool(_problems(constraints, e, headroom_bits)[0])
                                     for e, k in zip(tried, kept) if k or not any(kept)])


def holds_within(groups, constraints: list[Constraint], headroom_bits: float, n: int, rtol: float = PEAK_RTOL) -> bool:
    """Whether the plan's decisions (`_decisions`) stay what they are with every measured peak `rtol` larger, and with
    every one `rtol` smaller: then peaks measured from bfloat16 products (within `rtol` of float32's,
    halfsafe.engine.calib_arith) choose what float32's choose. A moved weight's peak is exact and stays."""
    base = _decisions(groups, constraints, headroom_bits, n)
    for shift in (math.log2(1 + rtol), math.log2(1 - rtol)):
        moved = [c if c.site.startswith("weight:") else Constraint(c.site, c.log2_peak + shift, c.powers) for c in constraints]
        if _decisions(groups, moved, headroom_bits, n) != base:
            return False
    return True


def _evaluate_all(model, family, groups, constraints, reference, headroom_bits, n, eval_ids, ref,
                  progress: bool = False, arith: str = "native") -> list[Candidate]:
    """Every candidate of `candidate_exponents`, those that keep the margin run in fp16; one whose exponents make the
    same model as one already run (`model_key`) takes that one's measurement instead of running again."""
    tried, measured = [], {}
    for e in candidate_exponents(groups, constraints, headroom_bits, n):
        kept, left = keeps_margin(constraints, e, reference, headroom_bits)
        if not kept:
            c = Candidate(dict(e), math.nan, math.nan, False)
        else:
            key = model_key(groups, e)
            if key not in measured:
                name = f"candidate residual 2^{e['residual']}" if "residual" in e else "candidate"
                with phase(name, model, quiet=not progress):  # an fp16 copy made inside is counted too
                    measured[key] = evaluate_candidate(model, family, groups, e, eval_ids, ref, arith)
            m = measured[key]
            c = Candidate(dict(e), m.kl, m.top1, m.finite)
        c.headroom_bits, c.keeps_margin = left, kept
        tried.append(c)
    return tried


def _choose_under(profile, model, family, groups, constraints, reference, headroom_bits, n, eval_ids, ref, report, samples,
                  progress):
    """convert --runtime: the candidates measured under the profile (halfsafe.runtime.choose), as Candidates."""
    rt = report.runtime if report.runtime is not None and report.runtime.profile == profile else \
        scan_with(model, samples, ScanOptions(fp16=Fp16Options(profile)), progress).runtime
    usual = candidate_exponents(groups, constraints, headroom_bits, n)
    exps, info = choose(model, family, groups, constraints, headroom_bits, usual, eval_ids, ref, rt)
    tried = []
    for c in info["candidates"]:
        kept, left = keeps_margin(constraints, c["exponents"], reference, headroom_bits)
        tried.append(Candidate(dict(c["exponents"]), c["kl"], c["top1"], c["finite"], left, kept))
    return next(c for c in tried if c.exponents == exps), tried, info


def _eval_ids(samples: list[torch.Tensor]) -> torch.Tensor:
    return prefix(samples[0], EVAL_TOKENS)


@torch.no_grad()
def make_fp16_safe(model: PreTrainedModel, samples: list[torch.Tensor] | None = None, tokenizer=None,
                   headroom_bits: float | None = None, allow_unfixable: bool = False, candidates: int = CANDIDATES,
                   progress: bool = True, max_context: int | None = None, runtime: str | RuntimeProfile | None = None,
                   fp16_arith: str | None = None) -> ConversionReport:
    """Rescale `model` (float32 weights) in place so that, cast to float16, it computes what it did
    in float32 without overflow. Options as for `plan_fp16_safe`. Returns what was measured, chosen
    and checked: the fp16 storage error of every touched tensor and the fp32 output change."""
    options = PlanOptions.checked(headroom_bits, max_context, allow_unfixable, candidates, runtime, fp16_arith)
    if samples is None:
        samples = default_samples(model, tokenizer)
    return rescale_with(model, samples, options, progress)


@torch.no_grad()
def rescale_with(model: PreTrainedModel, samples: list[torch.Tensor], options: PlanOptions,
                 progress: bool = True) -> ConversionReport:
    """`make_fp16_safe` for options already checked."""
    report = plan_with(model, samples, options, progress)
    quiet = not progress
    eval_ids = _eval_ids(samples)
    with report.reads.phase(model, "apply"):
        # the fp32 logits on eval_ids of the model as it was: planning measured them and left the model as it was
        ref, report.reference_logits = report.reference_logits, None
        with phase("apply", quiet=quiet):
            report.storage = apply_measured_(model, report.plan)
        with phase("check after", model, quiet=quiet):
            report.fp32_output_change = float((forward_logits(model, eval_ids).float() - ref).abs().max() / ref.abs().max())
    return report


def _layers_after(report: ScanReport, constraints: list[Constraint], exps: dict[str, int]) -> list[tuple[str, float]]:
    by_site = {c.site: c for c in constraints}
    out = []
    for layer in report.layers:
        c = by_site.get(str(Site(layer.name, "out")))
        out.append((layer.name, 2.0 ** predicted_log2(c, exps) if c else layer.residual_peak))
    return out


def apply_plan_(model: PreTrainedModel, plan: Plan) -> None:
    """Apply a saved plan to a model of the same architecture (in place). Refused, before any weight changes, if the
    model's names or shapes differ from the plan's, or if today's family data would move other tensors than the
    plan lists (a plan from another halfsafe version must never silently mean something else): `check_plan`."""
    family, groups = check_plan(model, plan)
    apply_exponents_(model, family, groups, plan.exponents)


def check_plan(model: PreTrainedModel, plan: Plan):
    """Whether `plan` fits `model` (see `apply_plan_`), refused in one line if not; nothing is read but names and
    shapes, so `apply` checks this right after loading, before anything slow. Returns (family, groups)."""
    if plan.model_type != model.config.model_type:
        raise HalfsafeError(f"the plan is for model_type {plan.model_type!r}, this model is {model.config.model_type!r}")
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    unknown = set(plan.exponents) - {g.name for g in groups}
    if unknown:
        raise HalfsafeError(f"the plan names groups this model does not have: {', '.join(sorted(unknown)[:5])}")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for t in plan.tensors:
        if t["param"] not in shapes:
            raise HalfsafeError(f"the plan moves {t['param']}, which this model does not have: it was made for another architecture")
        if "shape" in t and tuple(t["shape"]) != shapes[t["param"]]:
            raise HalfsafeError(f"{t['param']} is {list(shapes[t['param']])} here but {t['shape']} in the plan: "
                                "the plan was made for a model of another size")
    keyed = lambda rows: sorted((r["param"], r["kind"], r["exponent"], r["part"]) for r in rows)  # noqa: E731
    checked = plan.tensors or plan.format >= 2  # an empty list too; only a format-1 plan may come without one
    if checked and keyed(tensor_table(groups, plan.exponents)) != keyed(plan.tensors):
        raise HalfsafeError(f"the plan's tensor list (halfsafe {plan.halfsafe_version or '0.1.0'}) differs from what today's "
                            f"{family.name} data moves for the same groups: convert the model again")
    return family, groups


STORAGE_LIMIT = 0.01  # relative L2 error of a tensor's fp16 copy that means it is lost; rounding alone gives ~3e-4


def apply_measured_(model: PreTrainedModel, plan: Plan) -> list[dict]:
    """`apply_plan_`, with the fp16 storage error of every touched tensor before and after (see `storage_error`)."""
    touched = sorted({t["param"] for t in plan.tensors})
    values = weights_of(model).values()  # read as they are at each access: before, then after the plan
    before = {p: storage_error(value_blocks(values, p)) for p in touched}
    apply_plan_(model, plan)
    return [{"param": p, "before": before[p], "after": storage_error(value_blocks(values, p))} for p in touched]


def check_storage(storage: list[dict], fix: str) -> None:
    """Refuse, before anything is written, weights whose float16 copy the plan ruins: a value beyond 65504 (inf), or
    a tensor flushed (mostly) to zero, where its copy before the plan was fine."""
    for row in storage:
        before, after = row["before"], row["after"]
        if after["overflow"] > before["overflow"]:
            raise HalfsafeError(f"the plan makes {after['overflow']:,} values of {row['param']} exceed 65504, inf in float16: {fix}")
        if after["fp16_rel_error"] > max(STORAGE_LIMIT, before["fp16_rel_error"]):
            raise HalfsafeError(f"the plan flushes {row['param']} to zero in float16 ({after['fp16_rel_error']:.0%} of it lost): {fix}")


def convert_checkpoint(
    source: str,
    out: str,
    texts: list[str] | None = None,
    seq_len: int = CONVERT_TEXT.seq_len,
    max_samples: int | None = CONVERT_TEXT.max_samples,
    headroom_bits: float | None = None,
    allow_unfixable: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    max_context: int | None = None,
    long_sample: int | None = None,
    stream: bool = True,
    device: str = "auto",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    runtime: str | RuntimeProfile | None = None,
    fp16_arith: str | None = None,
    tokenizer: str | None = None,
    finish: Callable[[Path], None] | None = None,
    calib_arith: str | None = None,
) -> ConversionReport:
    """Load `source`, make it fp16-safe and save an ordinary fp16 checkpoint to `out`. `long_sample`:
    also calibrate on one sample of that many tokens (the embedded text repeated). `stream` (default): run and
    rewrite the model one block at a time from its shards (halfsafe.engine) where its layout allows, on `device`.
    `tokenizer`: a folder to take the tokenizer from (and save with the result) instead of MODEL's own.
    `finish(folder)` adds to the saved checkpoint in its temporary folder before it becomes `out` (convert --to onnx).
    `calib_arith`: how the calibration's matrix products compute ("auto", "float32", "bfloat16":
    halfsafe.engine.calib_arith). The options become one checked `ConvertRequest` (halfsafe.requests) before anything runs: `run_convert`."""
    request = ConvertRequest(
        source, out, TextOptions(texts, seq_len, max_samples, tokenizer),
        PlanOptions.checked(headroom_bits, max_context, allow_unfixable, runtime=runtime, fp16_arith=fp16_arith,
                            calib_arith=calib_arith),
        long_sample=long_sample, overwrite=overwrite, progress=progress, engine=EngineOptions(stream, device),
        max_shard_size=max_shard_size,
    )
    return run_convert(request, finish)


@recorded  # report.phases: the time each phase took, for the --json report; halfsafe.json holds no timings
def run_convert(request: ConvertRequest, finish: Callable[[Path], None] | None = None) -> ConversionReport:
    """`halfsafe convert`: `request` loaded, made fp16-safe under its checkpoint's runtime profile and saved;
    `finish(folder)` as for `convert_checkpoint`."""
    plan, source, long_sample = request.checkpoint_plan, request.source, request.long_sample

    def work(job: Job) -> Output[ConversionReport]:
        model = job.loaded.model
        report = rescale_with(model, job.samples, plan, request.progress)
        check_storage(report.storage, "refusing to save (please report this)")
        # halfsafe.json, written after the weights, counts their read
        return Output(report, lambda: report.record(str(source)), report.reads.phase(model, "write"))

    options = Options(text=request.text, engine=request.engine, overwrite=request.overwrite, progress=request.progress,
                      max_shard_size=request.max_shard_size)
    # the long sample goes last: samples[0] stays the probe/eval input
    return run(source, request.out, options, work,
               extra=(lambda tok, vocab: long_sample_ids(tok, vocab, long_sample)) if long_sample else None, finish=finish)


def apply_checkpoint(
    plan_path: str, source: str, out: str, texts: list[str] | None = None, seq_len: int = APPLY_TEXT.seq_len,
    max_samples: int | None = APPLY_TEXT.max_samples, overwrite: bool = False, progress: bool = True, stream: bool = True,
    device: str = "auto", tokenizer: str | None = None,
) -> tuple[Plan, ScanReport]:
    """Re-apply a saved plan (plan.json, or a converted folder's halfsafe.json) to another checkpoint of the same
    architecture (typically a fine-tune of the same base), scan the result briefly and save it as fp16. Refused, with
    nothing written, when the plan would ruin a tensor's fp16 copy or the scan finds the result not fp16-safe (a
    fine-tune can grow activations); the returned scan says whether the plan's margin was kept."""
    return run_apply(ApplyRequest(plan_path, source, out, TextOptions(texts, seq_len, max_samples, tokenizer), overwrite,
                                  progress, EngineOptions(stream, device)))


def run_apply(request: ApplyRequest) -> tuple[Plan, ScanReport]:
    """`halfsafe apply`, as `apply_checkpoint`."""
    plan_path, source, progress = request.plan_path, request.source, request.progress
    plans: list[Plan] = []

    def check() -> None:
        plans.append(Plan.load(plan_path))

    def work(job: Job) -> Output[tuple[Plan, ScanReport]]:
        model, plan = job.loaded.model, plans[0]
        storage = apply_measured_(model, plan)
        check_storage(storage, f"this plan does not suit these weights; nothing was written. Run `halfsafe convert {source} OUT` instead")
        after = scan(model, job.samples, fp16_check=True, progress=progress, name=str(source))
        peak = after.peak
        if not after.fp16_safe or after.first_nonfinite_fp16 is not None:  # never saved, never called safe
            where = f", first non-finite fp16 module {after.first_nonfinite_fp16}" if after.first_nonfinite_fp16 else ""
            raise HalfsafeError(f"not fp16-safe after the plan: peak {peak.abs_max:.4g} at {peak.name}{where}; this checkpoint's "
                                f"activations outgrew the plan and nothing was written. Run `halfsafe convert {source} OUT` instead")
        scanned = ScanAfter(after.fp16_safe, after.first_nonfinite_fp16, peak.name, peak.headroom_bits,
                            margin_kept=peak.headroom_bits >= plan.headroom_bits)
        return Output((plan, after), Record(str(source), applied=Applied(str(plan_path), plan, peak.abs_max, scanned, storage)))

    options = Options(text=request.text, engine=request.engine, overwrite=request.overwrite, progress=progress,
                      reads=(("the plan", plan_path),))
    return run(source, request.out, options, work, check,
               loaded_check=lambda loaded: check_plan(loaded.model, plans[0]))  # a plan that does not fit: before the slow part
