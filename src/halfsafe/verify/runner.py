"""Running one variant over every text: forward passes compared with the reference run, greedy generation,
timing, memory and residual peaks.

The reference's logits wait on disk and come back memory-mapped one sample at a time, so that only one model
and one sample's logits are in memory at once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..calibration import make_samples
from ..core.forward import is_encoder_decoder
from ..core.forward import logits as forward_logits
from ..core.weights import compute_device, weights_of
from ..engine.pipeline import in_step
from ..engine.reads import Reads
from ..engine.streamed import resident
from ..progress import phase
from .accumulator import Accumulator, matched_prefix
from .block_peaks import BlockPeaks
from .forced import capturing_processors, forced_rows, forced_tokens, start_length
from .memory import parameter_bytes, peak_memory
from .report import VariantResult
from .variants import Variant

log = logging.getLogger(__name__)


@dataclass
class Inputs:
    names: list[str]
    samples: list[list[torch.Tensor]]  # per text
    prompts: list[torch.Tensor]  # per text


def prepare_inputs(texts: list[str], names: list[str], tokenizer, vocab: int, seq_len: int, max_samples: int | None,
                   prompt_tokens: int) -> Inputs:
    """Each text cut into samples of `seq_len` tokens, and its first `prompt_tokens` as the greedy prompt."""
    samples = [make_samples([t], tokenizer, vocab, seq_len, max_samples) for t in texts]
    prompts = [s[0][:, :prompt_tokens] for s in samples]
    return Inputs(names, samples, prompts)


def predicts_tokens(model: PreTrainedModel) -> bool:
    """Whether the logits are over the vocabulary (an output embedding) and predict the next token or the
    teacher-forced target (the model generates): only then is a perplexity meaningful. Masked LMs have the
    first without the second; classifiers and headless models have neither."""
    return model.get_output_embeddings() is not None and model.can_generate()


@torch.no_grad()
def greedy(model: PreTrainedModel, prompt: torch.Tensor, n: int, cache_bytes: int = 0, use_cache: bool = True,
           logits: list | None = None) -> list[int]:
    """`n` greedily generated token ids after `prompt` ([1, len]); for encoder-decoder models the prompt is the
    encoder input and the decoder starts from its start token. End-of-sequence is suppressed so that every
    variant generates exactly `n` tokens. The model's own KV cache (transformers' DynamicCache, with the sliding and
    hybrid layers its config asks for) keeps the prompt's keys and values: each token after the first runs the model
    on that one token (an encoder-decoder's encoder runs once). A streamed model (halfsafe.engine) runs one forward per token: it holds
    its embeddings and head throughout and keeps up to `cache_bytes` of its blocks' weights loaded between tokens
    (`resident`); the blocks that do not fit are read again for every token. `use_cache=False` (tests: the same
    generation without a cache) runs the whole sequence for every token; `logits`, given a list, receives each step's."""
    sequence = generate(model, prompt, n, cache_bytes, use_cache, logits)
    return sequence[0, start_length(model, prompt):].tolist()


def generate(model: PreTrainedModel, prompt: torch.Tensor, n: int, cache_bytes: int = 0, use_cache: bool = True,
             logits: list | None = None, processors: list | None = None) -> torch.Tensor:
    """`greedy`'s whole generated sequence [1, start + n] (the prompt, or an encoder-decoder's start token, then the
    tokens), on the CPU; `processors`, given a list, receives the logits processors generate used (halfsafe.verify.forced)."""
    with weights_of(model).held(), resident(model, cache_bytes), capturing_processors(model, processors if processors is not None else []):
        return _greedy(model, prompt, n, use_cache, logits)


def _greedy(model: PreTrainedModel, prompt: torch.Tensor, n: int, use_cache: bool, logits: list | None) -> torch.Tensor:
    prompt = prompt.to(compute_device(model))
    gen = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=n, min_new_tokens=n,
        use_cache=use_cache,  # the model's own cache (sliding and hybrid layers too), whatever its saved configs say
        return_dict_in_generate=True, output_logits=logits is not None,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=getattr(model.config, "pad_token_id", model.config.get_text_config().pad_token_id),  # multimodal: text config
        bos_token_id=model.generation_config.bos_token_id,
        decoder_start_token_id=getattr(model.generation_config, "decoder_start_token_id", None),
    )
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gen)
    if logits is not None:
        logits.extend(step[0].float().cpu() for step in out.logits)
    return out.sequences.cpu()


class ReferenceCache:
    """The reference run's logits, one raw float32 file per sample in `folder`, and its greedy tokens per text.
    Read back a few rows at a time with ordinary reads (`Rows`): nothing is mapped, so the reference adds
    only those rows to the process's memory, not a second copy of a sample's logits."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.greedy: list[list[int]] = []
        # per text: (the reference's generated sequence, the logits processors its generate used) where its own
        # teacher-forced forward gave its generated tokens back, so the variants' greedy comes from one such forward;
        # None where they generate token by token
        self.teacher: list[tuple[torch.Tensor, object] | None] = []
        self.shapes: dict[tuple[int, int], tuple[int, ...]] = {}

    def _path(self, t: int, s: int) -> Path:
        return self.folder / f"ref-{t}-{s}.f32"

    def save(self, t: int, s: int, logits: torch.Tensor) -> None:
        logits.float().contiguous().numpy().tofile(self._path(t, s))
        self.shapes[t, s] = tuple(logits.shape)

    def load(self, t: int, s: int) -> "Rows":
        return Rows(self._path(t, s), self.shapes[t, s])


class Rows:
    """A stored [..., vocab] float32 tensor, rows of its [positions, vocab] view on request."""

    def __init__(self, path: Path, shape: tuple[int, ...]) -> None:
        self.path, self.shape = path, shape

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        vocab = self.shape[-1]
        hi = min(hi, math.prod(self.shape) // vocab)
        out = torch.empty(max(hi - lo, 0), vocab, dtype=torch.float32)
        with open(self.path, "rb") as f:
            f.seek(lo * vocab * 4)
            f.readinto(out.numpy())
        return out


class Runner:
    """Runs one model on every sample and prompt, compares to the stored reference."""

    def __init__(self, inputs: Inputs, blocks: list[str], greedy_tokens: int, ref_dir: Path, progress: Callable[[str], None],
                 collapse: bool = False):
        self.collapse = collapse  # also measure finite-but-collapsed outputs (verify --runtime)
        self.inputs = inputs
        self.blocks = blocks
        self.greedy_tokens = greedy_tokens
        self.refs = ReferenceCache(ref_dir)
        self.reads = Reads()  # passes over each checkpoint, per variant (its forwards, its greedy generation)
        self.progress = progress

    def run_reference(self, model: PreTrainedModel, variant: Variant) -> VariantResult:
        """Run the reference and store its logits and greedy tokens: every later run is compared to them."""
        return self._run(model, variant, reference=True)

    def run(self, model: PreTrainedModel, variant: Variant) -> VariantResult:
        """Run `model` and compare it with the stored reference."""
        return self._run(model, variant, reference=False)

    def _generate(self, model: PreTrainedModel, variant: Variant, t: int, text: str, logit_bytes: int, reference: bool) -> list[int]:
        """Greedy generation, token by token, from text t's prompt. The reference's also keeps its sequence and logits
        processors and checks that one teacher-forced forward gives its tokens back (verify.forced): if so, the
        variants' greedy agreement on this text comes from one forward each."""
        self.progress(f"{variant.name}: greedy generation, text {t + 1}")
        prompt, built = self.inputs.prompts[t], []
        # blocks stay loaded between tokens up to the bytes one sample's float32 logits took: generation then needs no
        # more memory than the forward passes did
        with self.reads.phase(model, f"{variant.name} greedy"), \
                phase(f"{variant.name} greedy{text}", model, passes=self.greedy_tokens, unit="tokens"):
            sequence = generate(model, prompt, self.greedy_tokens, cache_bytes=logit_bytes, processors=built)
        start = start_length(model, prompt)
        toks = sequence[0, start:].tolist()
        if reference:
            ok = len(built) == 1
            if ok:
                with self.reads.phase(model, f"{variant.name} greedy"), phase(f"{variant.name} greedy check{text}", model):
                    ok = forced_tokens(forced_rows(model, prompt, sequence), sequence, start, built[0]) == toks
            if not ok:
                log.warning("text %d: one forward over fp32's generated tokens does not give them back; every variant "
                            "generates its greedy tokens one by one", t + 1)
            self.refs.teacher.append((sequence, built[0]) if ok else None)
        return toks

    @torch.no_grad()
    def _run(self, model: PreTrainedModel, variant: Variant, reference: bool) -> VariantResult:
        lm = predicts_tokens(model)
        encdec = is_encoder_decoder(model)
        device = compute_device(model)
        peaks = BlockPeaks(model, self.blocks)
        overall, per_text, greedy_all = Accumulator(lm, self.collapse), [], []
        seconds, tokens, peak_act, method, logit_bytes = 0.0, 0, 0, "", 0
        try:
            for t, text_samples in enumerate(self.inputs.samples):
                acc = Accumulator(lm, self.collapse)
                measured = {}

                def forward(s, ids, t=t, n=len(text_samples)):
                    self.progress(f"{variant.name}: text {t + 1}/{len(self.inputs.samples)}, sample {s + 1}/{n}")
                    if t == 0 and s == 0:
                        out, measured["bytes"], measured["method"] = peak_memory(lambda: forward_logits(model, ids), device)
                        return out
                    return forward_logits(model, ids)

                def take(s, out, t=t, acc=acc):
                    nonlocal logit_bytes, comparing
                    began, ids = time.perf_counter(), text_samples[s]
                    out = out.cpu()  # in its own dtype: the comparison widens a few positions at a time (exactly)
                    logit_bytes = max(logit_bytes, out.numel() * 4)
                    if reference:
                        self.refs.save(t, s, out)
                    ref = out if reference else self.refs.load(t, s)  # the reference is its own reference
                    acc.add(ref, out, ids, encdec)
                    comparing += time.perf_counter() - began

                runs = [partial(forward, s, ids) for s, ids in enumerate(text_samples)]
                greedy_here = self.greedy_tokens > 0 and model.can_generate()
                teacher = self.refs.teacher[t] if greedy_here and not reference else None
                if teacher is not None:  # its greedy agreement from one forward, in step with its samples (verify.forced)
                    runs.append(partial(forced_rows, model, self.inputs.prompts[t], teacher[0]))
                n_samples, got = len(text_samples), {}

                def then(i, out):
                    if i < n_samples:
                        take(i, out)
                    else:
                        got["rows"] = out

                # the samples in step (each unit read once for all), compared one at a time in order; CUDA counts every
                # allocation, so there the measured first sample runs alone
                alone = 1 if t == 0 and device.type == "cuda" else 0
                start, comparing = time.perf_counter(), 0.0
                text = "" if len(self.inputs.samples) == 1 else f", text {t + 1}"
                with self.reads.phase(model, variant.name), phase(f"{variant.name}{text}", model, passes=len(runs), pass_name=None):
                    for lo, hi in ((0, alone), (alone, len(runs))):
                        in_step(model, runs[lo:hi], then=lambda i, out, lo=lo: then(lo + i, out))
                seconds += time.perf_counter() - start - comparing
                tokens += sum(ids.numel() for ids in text_samples) + (teacher[0].shape[1] - 1 if teacher is not None else 0)
                if measured:
                    peak_act, method = measured["bytes"], measured["method"]
                if teacher is not None:
                    sequence, processors = teacher
                    toks = forced_tokens(got.pop("rows"), sequence, start_length(model, self.inputs.prompts[t]), processors)
                elif greedy_here:
                    toks = self._generate(model, variant, t, text, logit_bytes, reference)
                if greedy_here:
                    greedy_all.append(toks)
                    ref_toks = toks if reference else self.refs.greedy[t]
                    acc.add_greedy(matched_prefix(ref_toks, toks), len(ref_toks))
                per_text.append(acc.metrics())
                overall.merge(acc)
        finally:
            peaks.remove()
        if reference:
            self.refs.greedy = greedy_all
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

