"""`verify` itself: load the original, build each variant from its record, run it against the float32 run,
and gather the report.

Memory: a folder (or fixture name) is run block by block (halfsafe.engine): its weights stay in the checkpoint and
each variant is the same streamed model loading its units in that variant's dtype; the converted folder is streamed
the same way, in float16. An in-memory original is loaded once and each 16-bit model is made from it with cast_copy
(or loaded from the converted folder) once per source and dtype, and freed before the next.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from contextlib import contextmanager
from itertools import groupby
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from ..calibration import fit_positions, heldout_text, position_limit
from ..core.sites import find_blocks
from ..core.weights import compute_device
from ..engine.device import exact_fp16_reductions, resolve_device, return_freed_memory
from ..engine.fp16_arith import NATIVE, resolve
from ..engine.fp16_arith import fp16_arith as fp16_arith_mode
from ..engine.precision import as_dtype, cast_copy
from ..errors import HalfsafeError
from ..io import loading  # loading.load_model: read when called, where the tests replace it
from ..progress import phase, recorded
from ..requests import GREEDY_TOKENS, PROMPT_TOKENS, VERIFY_TEXT, EngineOptions, Fp16Options, TextOptions, VerifyRequest
from ..runtime.profiles import RuntimeProfile
from .converted import check_converted, load_converted
from .report import VariantResult, VerifyReport, environment
from .runner import Runner, prepare_inputs
from .variants import ALL_VARIANTS, FP16, HALFSAFE, REFERENCE, VARIANTS, Variant, under_runtime


def verify(
    model: str | Path | PreTrainedModel,
    converted: str | Path | PreTrainedModel | None = None,
    texts: list[str] | None = None,
    text_names: list[str] | None = None,
    tokenizer=None,
    seq_len: int = VERIFY_TEXT.seq_len,
    max_samples: int | None = VERIFY_TEXT.max_samples,
    greedy_tokens: int = GREEDY_TOKENS,
    prompt_tokens: int = PROMPT_TOKENS,
    variants: list[str] | None = None,
    device: str | torch.device = "auto",
    progress: Callable[[str], None] | None = None,
    stream: bool = True,
    runtime: str | RuntimeProfile | None = None,
    fp16_arith: str | None = None,
    tokenizer_folder: str | Path | None = None,
) -> VerifyReport:
    """Compare every variant of `model` (a folder/fixture name/hub id, or a float32 model) with its float32
    run on `texts` (default: the embedded held-out text, never used for calibration).

    `converted`: the converted checkpoint (folder, or a float16 model) for the halfsafe variants.
    `max_samples`: samples of `seq_len` tokens per text at most (None: the whole text). `greedy_tokens`: tokens
    generated from the first `prompt_tokens` tokens of each text (0: skip). `variants`: a subset of
    ALL_VARIANTS (the fp32 reference always runs). `progress`: called with a short status line.
    `stream`: run a folder (original and converted) block by block from its shards (halfsafe.engine), holding one
    block's weights at a time; False loads each whole. `device`: where it computes ("cpu", "cuda", "auto").
    `runtime`: a runtime profile (halfsafe.runtime.profiles); other than "torch", the fp16 and halfsafe fp16 variants also run
    under its float16 arithmetic, emulated ("<variant> @ <profile>"), and every variant is checked for outputs that
    are finite but collapsed (nearly uniform rows, one token on top everywhere). `fp16_arith`: how the float16
    variants compute ("emulated", the default where proven, or "native": halfsafe.engine.fp16_arith).
    `tokenizer_folder`: where `model` is loaded here, take its tokenizer from this folder (--tokenizer).
    The options become one checked `VerifyRequest` (halfsafe.requests) before anything loads: `run_verify`.
    """
    return run_verify(VerifyRequest(
        model, converted, TextOptions(texts, seq_len, max_samples, tokenizer_folder or None),
        text_names, tokenizer, greedy_tokens, prompt_tokens, variants, EngineOptions(stream, device),
        Fp16Options.checked(runtime, fp16_arith), progress,
    ))


@recorded  # report.phases: the time each phase took
def run_verify(request: VerifyRequest) -> VerifyReport:
    """`halfsafe verify`, as `verify`."""
    model, converted, tokenizer, progress = request.model, request.converted, request.tokenizer, request.progress
    text, stream, device, profile = request.text, request.engine.stream, request.engine.device, request.runtime
    texts, text_names = text.text_list, list(request.text_names) if request.text_names is not None else None
    seq_len, max_samples, greedy_tokens, prompt_tokens = text.seq_len, text.max_samples, request.greedy_tokens, request.prompt_tokens
    variants = list(request.variants) if request.variants is not None else None

    progress = progress or (lambda msg: None)
    name = str(model) if not isinstance(model, nn.Module) else getattr(model.config, "_name_or_path", "") or type(model).__name__
    if isinstance(model, nn.Module):
        original = model
        if str(device) != "auto":  # a model object stays where it is unless a device is named
            original.to(resolve_device(device))
    else:
        with phase("load"):
            loaded = loading.load_model(model, torch.float32, stream=stream, device=device,
                                        **({"tokenizer": text.tokenizer} if text.tokenizer else {}))
        original, tokenizer = loaded.model, tokenizer if tokenizer is not None else loaded.tokenizer
    if next(original.parameters()).dtype != torch.float32:
        raise HalfsafeError("verify needs the original in float32 (the reference); load it with dtype=torch.float32")
    dev = compute_device(original)
    arith = resolve(request.fp16.fp16_arith, original)
    todo, skipped = _with_runtime(variants, converted is not None, profile)
    if converted is not None and not isinstance(converted, nn.Module):
        check_converted(converted, original)  # fail before the slow part
    if texts is None:
        texts, text_names = [heldout_text()], ["held-out text (embedded)"]
    text_names = text_names or [f"text {i + 1}" for i in range(len(texts))]  # one per text (VerifyRequest)
    vocab = original.config.get_text_config().vocab_size
    seq_len = fit_positions(original, seq_len, lambda said: print(f"note: {said}", file=sys.stderr))
    limit = position_limit(original)
    if greedy_tokens and limit is not None and prompt_tokens + greedy_tokens > limit:  # generation runs past the table
        print(f"note: {max(0, limit - prompt_tokens)} greedy tokens, not {greedy_tokens}: the model's learned positions "
              f"end at {limit}", file=sys.stderr)
        greedy_tokens = max(0, limit - prompt_tokens)
    inputs = prepare_inputs(texts, text_names, tokenizer, vocab, seq_len, max_samples, prompt_tokens)
    loaded = tokenizer = None  # only the ids are needed from here on (Gemma 3's tokenizer: 0.33 GB)
    return_freed_memory()
    blocks = find_blocks(original)
    results: list[VariantResult] = []
    with tempfile.TemporaryDirectory(prefix="halfsafe-verify-") as ref_dir, exact_fp16_reductions():
        runner = Runner(inputs, blocks, greedy_tokens, Path(ref_dir), progress)
        runner.collapse = not profile.is_torch  # also measure finite-but-collapsed outputs
        results.append(runner.run_reference(original, VARIANTS[REFERENCE]))
        for (from_converted, dtype), group in groupby(todo, key=lambda v: (v.converted, v.torch_dtype)):
            with _built(original, converted, from_converted, dtype, stream, dev, progress) as built, \
                    fp16_arith_mode(arith["used"] if dtype == torch.float16 else NATIVE):  # how float16 variants compute
                for variant in group:
                    _run_patched(runner, built, variant, results, skipped)
            del built  # before the next group's model is made
            gc.collect()
    return VerifyReport(
        model=name,
        converted=None if converted is None else (str(converted) if not isinstance(converted, nn.Module) else "(model object)"),
        model_type=original.config.model_type,
        texts=[{"name": n, "samples": len(s), "tokens": sum(x.numel() for x in s)} for n, s in zip(inputs.names, inputs.samples)],
        seq_len=seq_len,
        greedy_tokens=greedy_tokens,
        prompt_tokens=prompt_tokens,
        layers=blocks,
        results=results,
        skipped=skipped,
        environment=environment(dev),
        runtime=None if profile.is_torch else profile.to_dict(),
        checkpoint_reads=runner.reads.to_dict() if runner.reads else {},
        fp16_arith=arith,
    )


def _with_runtime(variants: list[str] | None, have_converted: bool, profile) -> tuple[list[Variant], dict[str, str]]:
    """_chosen, plus fp16 and halfsafe fp16 under a runtime profile ("<variant> @ <profile>", right after the plain
    one) wherever the plain one runs; `variants` may also name "<variant> @ <profile>" alone (the plain one is then
    not run)."""
    if profile.is_torch:
        return _chosen(variants, have_converted)
    under = {f"{b} @ {profile.name}": b for b in (FP16, HALFSAFE)}
    if variants is None:
        todo, skipped = _chosen(None, have_converted)
        return [w for v in todo for w in ([v, under_runtime(v, profile)] if v.name in (FP16, HALFSAFE) else [v])], skipped
    todo, skipped = _chosen([under.get(v, v) for v in variants], have_converted)
    asked = {under[v] for v in variants if v in under}
    plain = set(variants)
    out = []
    for v in todo:
        if v.name in plain:
            out.append(v)
        if v.name in asked or (v.name in plain and v.name in (FP16, HALFSAFE)):
            out.append(under_runtime(v, profile))
    return out, skipped


def _chosen(variants: list[str] | None, have_converted: bool) -> tuple[list[Variant], dict[str, str]]:
    """The variants to run after the reference, in ALL_VARIANTS order (variants that share weights are then
    next to each other), and the ones skipped, with why: without a converted checkpoint the converted variants,
    listed only when they were asked for by name."""
    wanted = list(ALL_VARIANTS) if variants is None else [REFERENCE, *[v for v in variants if v != REFERENCE]]
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise HalfsafeError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(ALL_VARIANTS)}")
    skipped: dict[str, str] = {}
    if not have_converted:
        for v in [v for v in wanted if VARIANTS[v].converted]:
            wanted.remove(v)
            if variants is not None:
                skipped[v] = "no converted checkpoint given"
    return [VARIANTS[v] for v in ALL_VARIANTS if v in wanted and v != REFERENCE], skipped


@contextmanager
def _built(original: PreTrainedModel, converted, from_converted: bool, dtype: torch.dtype, stream: bool, device, progress):
    """The model a group of variants runs on, for the duration: the original in `dtype` (a streamed original loads
    its units in `dtype`, restored after; an in-memory one is cast_copy'd, freed after), or the converted checkpoint
    (a folder in float16, streamed when `stream`; a model object cast to `dtype` unless it is in it already)."""
    if not from_converted:
        with as_dtype(original, dtype) as built:
            yield built if built is original else built.eval()  # a copy runs in eval mode, whatever the original's
        return
    progress("loading the converted checkpoint")
    if isinstance(converted, nn.Module):
        yield converted if next(converted.parameters()).dtype == dtype else cast_copy(converted, dtype).eval()
        return
    with phase("load converted"):
        built = load_converted(converted, original, stream=stream, device=device)
    yield built


def _run_patched(runner: Runner, model: PreTrainedModel, variant: Variant, results: list, skipped: dict) -> None:
    """Run `variant` on `model` (the right dtype already), with its run-time patch on for the duration."""
    try:
        handle = variant.patch(model)
    except HalfsafeError as e:
        skipped[variant.name] = str(e)
        return
    with handle:
        results.append(runner.run(model, variant))
