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
import platform
import tempfile
import time
from itertools import groupby
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from .. import __version__
from ..errors import HalfsafeError
from ..formats import FP16_MAX
from ..forward import is_encoder_decoder
from ..forward import logits as forward_logits
from ..layers import find_blocks
from ..metrics import kl_per_token
from ..precision import cast_copy
from .block_peaks import BlockPeaks
from .memory import parameter_bytes, peak_memory
from .variants import (
    ALL_VARIANTS, BASELINES, BF16, CLAMP, CONVERTED, FP16, FP32_RESIDUAL, HALFSAFE, HALFSAFE_FP32_RESIDUAL, REFERENCE, VARIANTS,
    Variant,
)


@dataclass
class Metrics:
    """Fidelity of one variant on some tokens (one text, or all of them)."""

    positions: int = 0  # logit rows compared
    nonfinite_logits: int = 0
    nonfinite_positions: int = 0  # rows with any inf/NaN
    kl_mean: float = 0.0  # mean KL(fp32 || variant) per position, nats (NaN if any row is non-finite)
    top1: float = 0.0  # fraction of positions whose argmax matches fp32's
    perplexity: float | None = None  # exp(mean next-token NLL) of the text under this variant (None: not an LM)
    max_abs_logit_error: float = 0.0  # max |logit - fp32 logit| (NaN/inf if any logit is non-finite)
    greedy_matched: int | None = None  # generated tokens equal to fp32's before the first difference, summed
    greedy_total: int | None = None  # tokens generated (per prompt x prompts)

    @property
    def greedy_fraction(self) -> float | None:
        return self.greedy_matched / self.greedy_total if self.greedy_total else None

    def to_dict(self) -> dict:
        return {**asdict(self), "greedy_fraction": self.greedy_fraction}


@dataclass
class VariantResult:
    variant: Variant
    overall: Metrics
    per_text: list[Metrics]
    parameter_bytes: int
    peak_activation_bytes: int  # tensors live at once during one forward pass (first sample), beyond the weights
    memory_method: str
    layer_peaks: list[float]  # residual |x| max after each block (inf where non-finite), over all samples
    greedy_tokens: list[list[int]]  # per text
    forward_seconds: float  # all forward passes (not generation)
    forward_tokens: int

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def forward_tokens_per_s(self) -> float:
        return self.forward_tokens / self.forward_seconds if self.forward_seconds > 0 else math.nan

    def to_dict(self) -> dict:
        return {
            **self.variant.to_dict(),
            "overall": self.overall.to_dict(),
            "per_text": [m.to_dict() for m in self.per_text],
            "parameter_bytes": self.parameter_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "memory_method": self.memory_method,
            "layer_peaks": self.layer_peaks,
            "greedy_tokens": self.greedy_tokens,
            "forward_seconds": self.forward_seconds,
            "forward_tokens_per_s": self.forward_tokens_per_s,
        }


@dataclass
class VerifyReport:
    model: str
    converted: str | None
    model_type: str
    texts: list[dict]  # name, samples, tokens
    seq_len: int
    greedy_tokens: int
    prompt_tokens: int
    layers: list[str]
    results: list[VariantResult]
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why
    environment: dict = field(default_factory=dict)

    def result(self, name: str) -> VariantResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no variant {name!r} in this report (have: {', '.join(r.name for r in self.results)})")

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "converted": self.converted,
            "model_type": self.model_type,
            "texts": self.texts,
            "seq_len": self.seq_len,
            "greedy_tokens": self.greedy_tokens,
            "prompt_tokens": self.prompt_tokens,
            "reference": REFERENCE,
            "fp16_max": FP16_MAX,
            "layers": self.layers,
            "variants": [r.to_dict() for r in self.results],
            "skipped": self.skipped,
            "environment": self.environment,
        }


# --- measuring ---------------------------------------------------------------------------------------------------


def _predicts_tokens(model: PreTrainedModel) -> bool:
    """Whether the logits are over the vocabulary (an output embedding) and predict the next token or the
    teacher-forced target (the model generates): only then is a perplexity meaningful. Masked LMs have the
    first without the second; classifiers and headless models have neither."""
    return model.get_output_embeddings() is not None and model.can_generate()


@torch.no_grad()
def _nll_sum(logits: torch.Tensor, ids: torch.Tensor, encoder_decoder: bool, chunk: int = 64) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods (float64) and how many tokens it covers."""
    logits, ids = logits[0], ids[0].to(logits.device)
    if not encoder_decoder:  # position i predicts token i+1; teacher-forced decoders predict token i at i
        logits, ids = logits[:-1], ids[1:]
    total = 0.0
    for lo, tgt in zip(logits.split(chunk), ids.split(chunk)):
        lo = lo.double()
        total += float((torch.logsumexp(lo, -1) - lo.gather(-1, tgt[:, None])[:, 0]).sum())
    return total, int(ids.numel())


class _Accumulator:
    def __init__(self, lm: bool) -> None:
        self.lm = lm
        self.positions = self.nonfinite_logits = self.nonfinite_positions = self.top1_hits = self.nll_tokens = 0
        self.kl_sum = self.nll_sum = self.max_err = 0.0
        self.greedy_matched = self.greedy_total = 0
        self.has_greedy = False

    def add(self, ref: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, encoder_decoder: bool) -> None:
        vocab = ref.shape[-1]
        finite = torch.isfinite(out)
        self.nonfinite_logits += int(finite.numel() - finite.sum())
        self.nonfinite_positions += int((~finite.reshape(-1, vocab).all(-1)).sum())
        self.positions += ref.numel() // vocab
        self.kl_sum += float(kl_per_token(ref, out).sum())
        self.top1_hits += int((ref.argmax(-1) == out.argmax(-1)).sum())
        self.max_err = _nanmax(self.max_err, float((out - ref).abs().max()))
        if self.lm:
            nll, n = _nll_sum(out, ids, encoder_decoder)
            self.nll_sum += nll
            self.nll_tokens += n

    def add_greedy(self, matched: int, total: int) -> None:
        self.has_greedy = True
        self.greedy_matched += matched
        self.greedy_total += total

    def merge(self, other: _Accumulator) -> None:
        for k in ("positions", "nonfinite_logits", "nonfinite_positions", "top1_hits", "nll_tokens", "kl_sum", "nll_sum",
                  "greedy_matched", "greedy_total"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.max_err = _nanmax(self.max_err, other.max_err)
        self.has_greedy = self.has_greedy or other.has_greedy

    def metrics(self) -> Metrics:
        n = max(self.positions, 1)
        return Metrics(
            positions=self.positions,
            nonfinite_logits=self.nonfinite_logits,
            nonfinite_positions=self.nonfinite_positions,
            kl_mean=self.kl_sum / n,
            top1=self.top1_hits / n,
            perplexity=_exp(self.nll_sum / self.nll_tokens) if self.lm and self.nll_tokens else None,
            max_abs_logit_error=self.max_err,
            greedy_matched=self.greedy_matched if self.has_greedy else None,
            greedy_total=self.greedy_total if self.has_greedy else None,
        )


def _nanmax(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
        overall, per_text, greedy_all = _Accumulator(lm), [], []
        seconds, tokens, peak_act, method = 0.0, 0, 0, ""
        try:
            for t, text_samples in enumerate(self.inputs.samples):
                acc = _Accumulator(lm)
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
                    acc.add_greedy(_matched_prefix(ref_toks, toks), len(ref_toks))
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


def _check_converted(converted: str | Path, original: PreTrainedModel):
    """The converted folder's config, if it is a checkpoint of the original's architecture (checked up front)."""
    from ..loading import read_config

    folder = Path(converted).expanduser()
    if not folder.is_dir():
        raise HalfsafeError(f"converted checkpoint {converted} is not a folder: give the output folder of `halfsafe convert`")
    config = read_config(folder)
    if config.model_type != original.config.model_type:
        raise HalfsafeError(
            f"{converted} is a {config.model_type!r} model but the original is {original.config.model_type!r}: "
            "give the checkpoint converted from this model"
        )
    return config


def _load_converted(converted: str | Path, original: PreTrainedModel) -> PreTrainedModel:
    """The converted checkpoint in float16, every module float16 (transformers' fp32 islands turned off)."""
    from ..loading import model_class_for, quiet_transformers
    from ..runtime import load_pure_fp16

    folder = Path(converted).expanduser()
    config = _check_converted(converted, original)
    try:
        with quiet_transformers():
            model = load_pure_fp16(model_class_for(config), folder, local_files_only=True)
    except Exception as e:
        raise HalfsafeError(f"could not load the converted checkpoint in {folder} ({str(e).splitlines()[0][:200]})") from None
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = {n: tuple(p.shape) for n, p in original.named_parameters()}
    if theirs != ours:
        raise HalfsafeError(f"{converted} does not have the original's parameters (names or shapes differ): give the checkpoint converted from this model")
    return model.eval().to(original.device)


def environment(device: torch.device | None = None) -> dict:
    import os

    env = {
        "halfsafe": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device) if device is not None else "cpu",
    }
    if device is not None and device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
        _check_converted(converted, original)  # fail before the slow part
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
    return _load_converted(converted, original)


def _run_patched(runner: _Runner, model: PreTrainedModel, variant: Variant, results: list, skipped: dict) -> None:
    """Run `variant` on `model` (the right dtype already), with its run-time patch on for the duration."""
    try:
        handle = variant.patch(model)
    except HalfsafeError as e:
        skipped[variant.name] = str(e)
        return
    with handle:
        results.append(runner.run(model, variant))


def write_plots(report: VerifyReport, path: str | Path) -> list[Path]:
    """PATH: KL(fp32 || variant) per token as bars on a log axis (a non-finite variant gets a label, no bar).
    PATH with `-layers` before the suffix: residual peak per block, original (fp32 run) and converted (fp16
    run), against the fp16 limit."""
    from ..plots import plot_bars, plot_layer_peaks

    path = Path(path)
    bars = {}
    for r in report.results:
        if r.name == REFERENCE:
            continue
        kl = r.overall.kl_mean
        bars[r.name if math.isfinite(kl) else f"{r.name}\n(non-finite)"] = kl if math.isfinite(kl) else math.nan
    written = [plot_bars(bars, path, "mean KL(fp32 || variant) per token (nats)", f"{report.model}: divergence from float32, lower is better")]
    series = {"original (fp32 run)": report.result(REFERENCE).layer_peaks}
    for name in (HALFSAFE, FP16):
        try:
            peaks = report.result(name).layer_peaks
        except KeyError:
            continue
        if all(math.isfinite(p) for p in peaks):
            series[f"{name} (measured)"] = peaks
            break
    layers = path.with_name(f"{path.stem}-layers{path.suffix or '.png'}")
    written.append(plot_layer_peaks(series, layers, f"{report.model}: residual peak per layer, before and after"))
    return written


def markdown_table(report: VerifyReport) -> str:
    """The overall results as a GitHub markdown table (for a README)."""

    def num(x, spec):
        if x is None:
            return "-"
        return "NaN" if x != x else format(x, spec)

    def size(n: int) -> str:
        return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"

    lines = [
        "| variant | custom runtime code | non-finite logits | KL(fp32 ‖ variant) per token | top-1 agreement | perplexity "
        f"| greedy tokens = fp32 | max abs logit error | weights | peak activations |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.results:
        o = r.overall
        greedy = f"{o.greedy_matched}/{o.greedy_total}" if o.greedy_total else "-"
        kl = "0 (reference)" if r.name == REFERENCE else num(o.kl_mean, ".2e")
        top1 = "-" if r.name == REFERENCE else num(100 * o.top1, ".2f") + "%"
        lines.append(
            f"| {r.name} | {'yes' if r.variant.custom_runtime else 'no'} | {o.nonfinite_logits:,} | {kl} | {top1} "
            f"| {num(o.perplexity, '.3f')} | {greedy} | {num(o.max_abs_logit_error, '.3g')} | {size(r.parameter_bytes)} "
            f"| {size(r.peak_activation_bytes)} |"
        )
    return "\n".join(lines) + "\n"
