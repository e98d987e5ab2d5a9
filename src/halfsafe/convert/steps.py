"""`halfsafe convert`, step by step: each step one call, to the module that does it.

  1. load        job.run (halfsafe/job.py): the checkpoint (io/loading; streamed block by block where its layout
                 allows: engine/) and the calibration samples cut from the text
  2. scan        calibrate.py: the activation peaks on the samples (halfsafe/scan.py), the fp32 reference beside them
  3. probe       core/shrink.py's probe_governed: which activations each group of families/ really moves
  4. plan        plan.py: the constraints every group's exponent must keep (core/plan.py solves them); a bfloat16
                 calibration whose peaks could decide otherwise is run again in float32 (calibrate.py)
  5. candidates  candidates.py: plans around the solver's, run in float16 against the fp32 reference; one is chosen,
                 and a plan that leaves float16 overflowing is refused (plan.py)
  6. apply       apply.py: the chosen plan written into the weights (core/rewrite.py), each touched tensor's fp16
                 storage error measured before and after
  7. check       check.py: the fp32 output change, and a plan that ruins a tensor's fp16 copy refused
  8. write       job.run's save (io/checkpoint.py, engine/write.py): weights, tokenizer, halfsafe.json and the card,
                 atomically

`run_convert` is the command (1 and 8 around the work); `rescale_with` is steps 2-7 on a model in memory, `plan_with`
steps 2-5 (the model is left as it was). `run_apply` is `halfsafe apply`: steps 1, 6, 7 and 8 with a saved plan.
The keyword API over these is convert/__init__.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..calibration import long_sample_ids
from ..core.forward import prefix, sample_tokens
from ..core.groups import expand
from ..core.margin import choose_margin
from ..core.plan import Plan
from ..core.shrink import probe_governed
from ..engine.fp16_arith import resolve as resolve_arith
from ..engine.reads import Reads
from ..errors import HalfsafeError
from ..families import family_for
from ..io.report import Applied, Record, ScanAfter
from ..job import Job, Options, Output, run
from ..progress import phase, recorded
from ..requests import ApplyRequest, ConvertRequest, PlanOptions
from ..scan import ScanReport, scan
from .apply import apply_measured_
from .calibrate import again_in_float32, calibrate
from .candidates import _eval_ids, reference_logits, try_candidates
from .check import check_plan, check_storage, fp32_output_change
from .plan import _layers_after, _problems, plan_constraints, refuse_unfixable
from .report import ConversionReport

PROBE_TOKENS = 32


@recorded  # report.phases: the time each phase took, for the --json report; halfsafe.json holds no timings
def run_convert(request: ConvertRequest, finish: Callable[[Path], None] | None = None) -> ConversionReport:
    """`halfsafe convert`: `request` loaded, made fp16-safe under its checkpoint's runtime profile and saved;
    `finish(folder)` as for `convert_checkpoint`."""
    plan, source, long_sample = request.checkpoint_plan, request.source, request.long_sample

    def work(job: Job) -> Output[ConversionReport]:  # on what step 1 loaded
        model = job.loaded.model
        report = rescale_with(model, job.samples, plan, request.progress)  # 2-7
        check_storage(report.storage, "refusing to save (please report this)")  # 7: before anything is written
        # 8: halfsafe.json, written after the weights, counts their read
        return Output(report, lambda: report.record(str(source)), report.reads.phase(model, "write"))

    options = Options(text=request.text, engine=request.engine, overwrite=request.overwrite, progress=request.progress,
                      max_shard_size=request.max_shard_size)
    # 1. load, the work, 8. write; the long sample goes last: samples[0] stays the probe/eval input
    return run(source, request.out, options, work,
               extra=(lambda tok, vocab: long_sample_ids(tok, vocab, long_sample)) if long_sample else None, finish=finish)


@torch.no_grad()
def rescale_with(model: PreTrainedModel, samples: list[torch.Tensor], options: PlanOptions,
                 progress: bool = True) -> ConversionReport:
    """Steps 2-7: `make_fp16_safe` for options already checked."""
    report = plan_with(model, samples, options, progress)  # 2-5
    quiet = not progress
    eval_ids = _eval_ids(samples)
    with report.reads.phase(model, "apply"):
        # the fp32 logits on eval_ids of the model as it was: planning measured them and left the model as it was
        ref, report.reference_logits = report.reference_logits, None
        with phase("apply", quiet=quiet):  # 6
            report.storage = apply_measured_(model, report.plan)
        with phase("check after", model, quiet=quiet):  # 7
            report.fp32_output_change = fp32_output_change(model, eval_ids, ref)
    return report


@torch.no_grad()
def plan_with(model: PreTrainedModel, samples: list[torch.Tensor], options: PlanOptions, progress: bool = True,
              scan_report: ScanReport | None = None) -> ConversionReport:
    """Steps 2-5: `plan_fp16_safe` for options already checked."""
    profile = options.runtime
    arith = resolve_arith(options.fp16.fp16_arith, model)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    reads = Reads()
    eval_ids = _eval_ids(samples)
    # 2. scan
    report, calib, logits_fp32 = calibrate(model, samples, options, progress, scan_report, reads, eval_ids)
    # the margin kept under 65504, for the longest context asked (core/margin.py's rule)
    margin = choose_margin(model.config, max(sample_tokens(s) for s in samples), options.margin.max_context,
                           options.margin.headroom_bits)
    headroom_bits = margin.bits
    with reads.phase(model, "plan"):
        with phase("probe", quiet=not progress):  # 3. probe
            governed = probe_governed(model, family, groups, prefix(samples[0], PROBE_TOKENS))  # on a shrunk random copy
        with phase("plan", quiet=not progress):  # 4. plan
            constraints, weights = plan_constraints(model, groups, report, governed)
    # 2 and 4 again in float32 where a bfloat16 calibration's peaks sit too near a limit the plan is chosen at
    report, constraints = again_in_float32(model, samples, options, progress, reads, calib, report, groups, constraints,
                                           weights, governed, headroom_bits)
    # 5. candidates, against the fp32 reference (computed here where it did not run beside the scan)
    if "reference" not in logits_fp32:
        with reads.phase(model, "reference"), phase("reference", model, quiet=not progress):
            logits_fp32["reference"] = reference_logits(model, eval_ids)
    ref = logits_fp32["reference"]
    with reads.phase(model, "candidates"):
        chosen, tried, runtime_info = try_candidates(profile, model, family, groups, constraints, headroom_bits,
                                                     options.candidates, eval_ids, ref, report, samples, progress,
                                                     arith["used"])
    # what the chosen plan leaves above 65504 (refused unless --allow-unfixable) or inside the margin
    unfixable, tight = _problems(constraints, chosen.exponents, headroom_bits)
    refuse_unfixable(family, chosen.finite, unfixable, options.allow_unfixable)
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


def run_apply(request: ApplyRequest) -> tuple[Plan, ScanReport]:
    """`halfsafe apply`, as `apply_checkpoint`: steps 1, 6, 7 and 8 with a saved plan in place of 2-5; the result
    scanned again (halfsafe/scan.py) and refused where its activations outgrew the plan."""
    plan_path, source, progress = request.plan_path, request.source, request.progress
    plans: list[Plan] = []

    def check() -> None:
        plans.append(Plan.load(plan_path))

    def work(job: Job) -> Output[tuple[Plan, ScanReport]]:
        model, plan = job.loaded.model, plans[0]
        storage = apply_measured_(model, plan)  # 6
        # 7
        check_storage(storage, f"this plan does not suit these weights; nothing was written. Run `halfsafe convert {source} OUT` instead")
        after = scan(model, job.samples, fp16_check=True, progress=progress, name=str(source))
        peak = after.peak
        if not after.fp16_safe or after.first_nonfinite_fp16 is not None:  # never saved, never called safe
            where = f", first non-finite fp16 module {after.first_nonfinite_fp16}" if after.first_nonfinite_fp16 else ""
            raise HalfsafeError(f"not fp16-safe after the plan: peak {peak.abs_max:.4g} at {peak.name}{where}; this checkpoint's "
                                f"activations outgrew the plan and nothing was written. Run `halfsafe convert {source} OUT` instead")
        scanned = ScanAfter(after.fp16_safe, after.first_nonfinite_fp16, peak.name, peak.headroom_bits,
                            margin_kept=peak.headroom_bits >= plan.headroom_bits)
        # 8
        return Output((plan, after), Record(str(source), applied=Applied(str(plan_path), plan, peak.abs_max, scanned, storage)))

    options = Options(text=request.text, engine=request.engine, overwrite=request.overwrite, progress=progress,
                      reads=(("the plan", plan_path),))
    return run(source, request.out, options, work, check,
               loaded_check=lambda loaded: check_plan(loaded.model, plans[0]))  # a plan that does not fit: before the slow part
