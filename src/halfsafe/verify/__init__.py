"""`verify`: how faithfully each way of running a model in 16 bits reproduces the float32 original.

Variants (the fp32 original is the reference; every other variant is compared to it on the same tokens):
- bf16, fp16: the original cast to that dtype (plain transformers, no custom code)
- fp16 clamp: fp16 with each residual add clamped to +-32752, as fp16 ONNX exports of Gemma 3 do (custom code)
- fp16 + fp32 residual: fp16 weights and matmuls, residual stream in fp32 (custom code)
- halfsafe fp16: the converted checkpoint loaded in fp16 (plain transformers), and with an fp32 residual

Per text and overall: non-finite logits, mean KL(fp32 || variant) per token, top-1 agreement, perplexity of the
text, max |logit error|, and how many greedily generated tokens match fp32's from the start of each text. Per
variant: parameter bytes and peak activation bytes of one forward pass, and the residual peak per block.

Memory: the fp32 original is loaded once; each 16-bit model is made from it with cast_copy (or loaded from the
converted folder) one at a time and freed before the next; reference logits wait on disk (memory-mapped).
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from itertools import groupby
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from ..errors import HalfsafeError
from ..forward import is_encoder_decoder
from ..forward import logits as forward_logits
from ..layers import find_blocks
from ..precision import cast_copy
from .block_peaks import BlockPeaks
from .accumulator import Accumulator, matched_prefix
from .accumulator import Accumulator as _Accumulator  # noqa: F401
from .accumulator import matched_prefix as _matched_prefix  # noqa: F401
from .accumulator import nll_sum as _nll_sum  # noqa: F401
from .memory import parameter_bytes, peak_memory
from .report import Metrics, VariantResult, VerifyReport, environment, markdown_table
from .converted import check_converted, load_converted
from .plots import write_plots
from .variants import (
    ALL_VARIANTS, BASELINES, BF16, CLAMP, CONVERTED, FP16, FP32_RESIDUAL, HALFSAFE, HALFSAFE_FP32_RESIDUAL, REFERENCE, VARIANTS,
    Variant,
)


# --- measuring ---------------------------------------------------------------------------------------------------


def _predicts_tokens(model: PreTrainedModel) -> bool:
    """Whether the logits are over the vocabulary (an output embedding) and predict the next token or the
    teacher-forced target (the model generates): only then is a perplexity meaningful. Masked LMs have the
    first without the second; classifiers and headless models have neither."""
    return model.get_output_embeddings() is not None and model.can_generate()


@torch.no_grad()
def greedy(model: PreTrainedModel, prompt: torch.Tensor, n: int) -> list[int]:
    """`n` greedily generated token ids after `prompt` ([1, len]); for encoder-decoder models the prompt is the
    encoder input and the decoder starts from its start token. End-of-sequence is suppressed so that every
    variant generates exactly `n` tokens."""
    prompt = prompt.to(model.device)
    gen = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=n, min_new_tokens=n,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=getattr(model.config, "pad_token_id", model.config.get_text_config().pad_token_id),  # multimodal: text config
        bos_token_id=model.generation_config.bos_token_id,
        decoder_start_token_id=getattr(model.generation_config, "decoder_start_token_id", None),
    )
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gen)
    start = 1 if is_encoder_decoder(model) else prompt.shape[1]
    return out[0, start:].tolist()


# --- the run ----------------------------------------------------------------------------------------------------


@dataclass
class _Inputs:
    names: list[str]
    samples: list[list[torch.Tensor]]  # per text
    prompts: list[torch.Tensor]  # per text


def _prepare(texts: list[str], names: list[str], tokenizer, vocab: int, seq_len: int, max_samples: int | None, prompt_tokens: int) -> _Inputs:
    from ..calibration import make_samples

    samples = [make_samples([t], tokenizer, vocab, seq_len, max_samples) for t in texts]
    prompts = [s[0][:, :prompt_tokens] for s in samples]
    return _Inputs(names, samples, prompts)


class _Runner:
    """Runs one model on every sample and prompt, compares to the stored reference."""

    def __init__(self, inputs: _Inputs, blocks: list[str], greedy_tokens: int, ref_dir: Path, progress: Callable[[str], None]):
        self.inputs = inputs
        self.blocks = blocks
        self.greedy_tokens = greedy_tokens
        self.ref_dir = ref_dir
        self.progress = progress
        self.ref_greedy: list[list[int]] | None = None

    def _ref_path(self, t: int, s: int) -> Path:
        return self.ref_dir / f"ref-{t}-{s}.pt"

    def run_reference(self, model: PreTrainedModel, variant: Variant) -> VariantResult:
        """Run the reference and store its logits and greedy tokens: every later run is compared to them."""
        return self._run(model, variant, reference=True)

    def run(self, model: PreTrainedModel, variant: Variant) -> VariantResult:
        """Run `model` and compare it with the stored reference."""
        return self._run(model, variant, reference=False)

    @torch.no_grad()
    def _run(self, model: PreTrainedModel, variant: Variant, reference: bool) -> VariantResult:
        lm = _predicts_tokens(model)
        encdec = is_encoder_decoder(model)
        device = model.device
        peaks = BlockPeaks(model, self.blocks)
        overall, per_text, greedy_all = Accumulator(lm), [], []
        seconds, tokens, peak_act, method = 0.0, 0, 0, ""
        try:
            for t, text_samples in enumerate(self.inputs.samples):
                acc = Accumulator(lm)
                for s, ids in enumerate(text_samples):
                    self.progress(f"{variant.name}: text {t + 1}/{len(self.inputs.samples)}, sample {s + 1}/{len(text_samples)}")

                    def forward(ids=ids):
                        return forward_logits(model, ids)

                    start = time.perf_counter()
                    if t == 0 and s == 0:
                        out, peak_act, method = peak_memory(forward, device)
                    else:
                        out = forward()
                    seconds += time.perf_counter() - start
                    tokens += ids.numel()
                    out = out.float().cpu()
                    if reference:
                        torch.save(out, self._ref_path(t, s))
                    ref = torch.load(self._ref_path(t, s), mmap=True)
                    acc.add(ref, out, ids, encdec)
                    del out, ref
                if self.greedy_tokens > 0 and model.can_generate():
                    self.progress(f"{variant.name}: greedy generation, text {t + 1}")
                    toks = greedy(model, self.inputs.prompts[t], self.greedy_tokens)
                    greedy_all.append(toks)
                    ref_toks = toks if reference else self.ref_greedy[t]
                    acc.add_greedy(matched_prefix(ref_toks, toks), len(ref_toks))
                per_text.append(acc.metrics())
                overall.merge(acc)
        finally:
            peaks.remove()
        if reference:
            self.ref_greedy = greedy_all
        return VariantResult(
            variant=variant,
            overall=overall.metrics(),
            per_text=per_text,
            parameter_bytes=parameter_bytes(model),
            peak_activation_bytes=peak_act,
            memory_method=method,
            layer_peaks=peaks.peaks,
            greedy_tokens=greedy_all,
            forward_seconds=seconds,
            forward_tokens=tokens,
        )


def verify(
    model: str | Path | PreTrainedModel,
    converted: str | Path | PreTrainedModel | None = None,
    texts: list[str] | None = None,
    text_names: list[str] | None = None,
    tokenizer=None,
    seq_len: int = 512,
    max_samples: int | None = 2,
    greedy_tokens: int = 32,
    prompt_tokens: int = 16,
    variants: list[str] | None = None,
    device: str | torch.device | None = None,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Compare every variant of `model` (a folder/fixture name/hub id, or a float32 model) with its float32
    run on `texts` (default: the embedded held-out text, never used for calibration).

    `converted`: the converted checkpoint (folder, or a float16 model) for the halfsafe variants.
    `max_samples`: samples of `seq_len` tokens per text at most (None: the whole text). `greedy_tokens`: tokens
    generated from the first `prompt_tokens` tokens of each text (0: skip). `variants`: a subset of
    ALL_VARIANTS (the fp32 reference always runs). `progress`: called with a short status line.
    """
    from ..calibration import heldout_text
    from ..loading import load_model

    progress = progress or (lambda msg: None)
    name = str(model) if not isinstance(model, nn.Module) else getattr(model.config, "_name_or_path", "") or type(model).__name__
    if isinstance(model, nn.Module):
        original = model
    else:
        loaded = load_model(model, torch.float32)
        original, tokenizer = loaded.model, tokenizer if tokenizer is not None else loaded.tokenizer
    if next(original.parameters()).dtype != torch.float32:
        raise HalfsafeError("verify needs the original in float32 (the reference); load it with dtype=torch.float32")
    if device is not None:
        original.to(device)
    dev = original.device
    wanted = list(ALL_VARIANTS) if variants is None else [REFERENCE, *[v for v in variants if v != REFERENCE]]
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise HalfsafeError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(ALL_VARIANTS)}")
    skipped: dict[str, str] = {}
    if converted is not None and not isinstance(converted, nn.Module):
        check_converted(converted, original)  # fail before the slow part
    if converted is None:
        for v in [v for v in wanted if VARIANTS[v].converted]:
            wanted.remove(v)
            if variants is not None:
                skipped[v] = "no converted checkpoint given"
    if texts is None:
        texts, text_names = [heldout_text()], ["held-out text (embedded)"]
    text_names = text_names or [f"text {i + 1}" for i in range(len(texts))]
    if len(text_names) != len(texts):
        raise HalfsafeError("give one name per text")
    vocab = original.config.get_text_config().vocab_size
    inputs = _prepare(texts, text_names, tokenizer, vocab, seq_len, max_samples, prompt_tokens)
    blocks = find_blocks(original)
    results: list[VariantResult] = []
    with tempfile.TemporaryDirectory(prefix="halfsafe-verify-") as ref_dir, _exact_fp16_reductions(dev):
        runner = _Runner(inputs, blocks, greedy_tokens, Path(ref_dir), progress)
        results.append(runner.run_reference(original, VARIANTS[REFERENCE]))
        todo = [VARIANTS[v] for v in ALL_VARIANTS if v in wanted and v != REFERENCE]
        for (from_converted, dtype), group in groupby(todo, key=lambda v: (v.converted, v.torch_dtype)):
            built = _build(original, converted, from_converted, dtype, progress)
            try:
                for variant in group:
                    _run_patched(runner, built, variant, results, skipped)
            finally:
                del built
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
    )


class _exact_fp16_reductions:
    """On CUDA, fp16 GEMMs may otherwise accumulate partial sums in fp16 (PyTorch's default): verify measures
    the format, not that shortcut, so it is switched off for the duration."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.saved = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        if self.cuda:
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = self.saved


def _build(original: PreTrainedModel, converted, from_converted: bool, dtype: torch.dtype, progress) -> PreTrainedModel:
    """The model a group of variants runs on: the original cast to `dtype`, or the converted checkpoint (a
    folder is loaded in float16; a model object is cast to `dtype` unless it is in it already)."""
    if not from_converted:
        return cast_copy(original, dtype).eval()
    progress("loading the converted checkpoint")
    if isinstance(converted, nn.Module):
        return converted if next(converted.parameters()).dtype == dtype else cast_copy(converted, dtype).eval()
    return load_converted(converted, original)


def _run_patched(runner: _Runner, model: PreTrainedModel, variant: Variant, results: list, skipped: dict) -> None:
    """Run `variant` on `model` (the right dtype already), with its run-time patch on for the duration."""
    try:
        handle = variant.patch(model)
    except HalfsafeError as e:
        skipped[variant.name] = str(e)
        return
    with handle:
        results.append(runner.run(model, variant))
