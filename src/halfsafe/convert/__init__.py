"""The Python API of `halfsafe convert` and `halfsafe apply`: keyword arguments checked into one request
(halfsafe.requests), then the steps (steps.py, read top to bottom: load, scan, probe, plan, candidates, apply, check,
write). Every name this package gave before it became one is importable from here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..calibration import default_text, make_samples
from ..core.plan import Plan
from ..requests import (
    APPLY_TEXT,
    CANDIDATES,
    CONVERT_TEXT,
    DEFAULT_MAX_SHARD_SIZE,
    ApplyRequest,
    ConvertRequest,
    EngineOptions,
    PlanOptions,
    TextOptions,
)
from ..runtime.profiles import RuntimeProfile
from ..scan import ScanReport
from .apply import apply_measured_, apply_plan_
from .calibrate import ROUTER_FIELDS, calibration_arith, holds_within, routes_tokens
from .candidates import (
    CANDIDATES_ABOVE,
    EVAL_TOKENS,
    _eval_ids,
    candidate_exponents,
    choose_candidate,
    evaluate_candidate,
    keeps_margin,
)
from .check import STORAGE_LIMIT, check_plan, check_storage, storage_error
from .plan import _layers_after, _problems
from .report import Candidate, ConversionReport
from .steps import PROBE_TOKENS, plan_with, rescale_with, run_apply, run_convert

__all__ = [
    "CANDIDATES_ABOVE", "EVAL_TOKENS", "PROBE_TOKENS", "ROUTER_FIELDS", "STORAGE_LIMIT", "Candidate", "ConversionReport",
    "_eval_ids", "_layers_after", "_problems", "apply_checkpoint", "apply_measured_", "apply_plan_", "calibration_arith",
    "candidate_exponents", "check_plan", "check_storage", "choose_candidate", "convert_checkpoint", "default_samples",
    "evaluate_candidate", "holds_within", "keeps_margin", "make_fp16_safe", "plan_fp16_safe", "plan_with",
    "rescale_with", "routes_tokens", "run_apply", "run_convert", "storage_error",
]


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
