"""Step 2, scan: the calibration's peaks (halfsafe/scan.py measures them), under the arithmetic it may use
(`calibration_arith`), with the fp32 reference of step 5 computed beside it in the same pass where it can; and, once
step 4 has its constraints, the check that peaks measured from bfloat16 products decide what float32's would
(`holds_within`), else the calibration runs again in float32 (`again_in_float32`)."""

from __future__ import annotations

import math

import torch

from ..core.plan import Constraint, site_constraints, solve
from ..core.shrink import EXPERT_FIELDS, TOP_K_FIELDS
from ..core.stats import is_fused_experts
from ..engine.calib_arith import BFLOAT16, FLOAT32, PEAK_RTOL
from ..engine.calib_arith import resolve as resolve_calib
from ..engine.device import return_freed_memory
from ..engine.reads import Reads
from ..requests import PlanOptions, ScanOptions
from ..scan import ScanReport, scan_with
from .candidates import candidate_exponents, keeps_margin, reference_logits
from .plan import _problems

ROUTER_FIELDS = (*EXPERT_FIELDS, "moe_num_experts", *TOP_K_FIELDS)  # a config that counts or picks experts


def calibrate(model, samples: list[torch.Tensor], options: PlanOptions, progress: bool, scan_report: ScanReport | None,
              reads: Reads, eval_ids: torch.Tensor) -> tuple[ScanReport, dict | None, dict[str, torch.Tensor]]:
    """The step: (the scan, how it multiplied or None where `scan_report` was given, {"reference": the fp32 logits on
    `eval_ids`} where they were computed beside the scan, else {})."""
    calib = None if scan_report is not None else calibration_arith(options, model)
    logits_fp32: dict[str, torch.Tensor] = {}

    def reference() -> None:
        logits_fp32["reference"] = reference_logits(model, eval_ids)

    # beside the scan's samples, in the same pass, where convert calibrates with no runtime collector
    beside = [reference] if calib is not None and options.runtime.is_torch else []
    with reads.phase(model, "scan"):
        report = scan_report or scan_with(model, samples, ScanOptions(fp16=options.fp16, calib_arith=calib["used"]),
                                          progress, beside=beside)
    return_freed_memory()  # what the scan's forward passes freed, before the candidates' run
    return report, calib, logits_fp32


def again_in_float32(model, samples: list[torch.Tensor], options: PlanOptions, progress: bool, reads: Reads,
                     calib: dict | None, report: ScanReport, groups, constraints: list[Constraint],
                     weights: list[Constraint], governed, headroom_bits: float) -> tuple[ScanReport, list[Constraint]]:
    """(the scan, the constraints), calibrated again in float32 where a bfloat16 calibration's peaks might decide
    otherwise than float32's (`holds_within`); as they were elsewhere."""
    if calib is not None and calib["used"] == BFLOAT16 and not holds_within(groups, constraints, headroom_bits, options.candidates):
        # a decision sits within bfloat16's difference of its limit: the float32 peaks decide it, as they would alone
        calib["float32_again"] = (f"a peak sat within {PEAK_RTOL:g} of a limit the plan is chosen at: calibrated again "
                                  "in float32")
        with reads.phase(model, "scan"):  # the reference ran beside the bfloat16 calibration already
            report = scan_with(model, samples, ScanOptions(fp16=options.fp16, calib_arith=FLOAT32), progress)
        constraints = site_constraints(report.sites, governed) + weights
    return report, constraints


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
