"""Greedy agreement from one forward: a variant's greedy tokens equal the reference's up to the first one that differs,
and up to there each is the argmax of the variant's next-token scores after the reference's own tokens. So one
teacher-forced forward over the reference's sequence (prompt and generated tokens) gives, position by position, what
the variant's generation would pick, up to and including its first different token: the agreement `matched_prefix`
counts, from one forward instead of one per token. For a streamed model that is one read of its weights instead of
one per token, and it runs in step with the variant's other forwards.

The scores are processed as `generate` processes them (suppressed end-of-sequence, forced tokens, repetition
penalties from the model's generation config): the processors are the ones the reference's own `generate` built
(`capturing_processors`). Whether the forward and the generation agree is checked on the reference itself: its
forced tokens must be its generated ones, or the variants generate token by token as before (`self_check`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from ..core.forward import is_encoder_decoder
from ..core.weights import compute_device


@contextmanager
def capturing_processors(model: PreTrainedModel, into: list):
    """Within: each `model.generate` appends the logits processors it built to `into` (nothing where this
    transformers builds them elsewhere: then nothing is captured and the variants generate token by token)."""
    build = getattr(type(model), "_get_logits_processor", None)
    if build is None:
        yield
        return

    def capture(*args, **kwargs):
        built = build(model, *args, **kwargs)
        into.append(built)
        return built

    model._get_logits_processor = capture  # this instance only, for this call
    try:
        yield
    finally:
        del model._get_logits_processor


def start_length(model: PreTrainedModel, prompt: torch.Tensor) -> int:
    """Tokens of a generated sequence before the first generated one: the prompt, or an encoder-decoder's start token."""
    return 1 if is_encoder_decoder(model) else prompt.shape[1]


@torch.no_grad()
def forced_rows(model: PreTrainedModel, prompt: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """[n, vocab] float32: the next-token logits `model` gives at each of the n generated positions of `sequence`
    ([1, start + n], the reference's generation after `prompt`), from one forward over the sequence."""
    device = compute_device(model)
    given = sequence[:, :-1].to(device)
    if is_encoder_decoder(model):
        prompt = prompt.to(device)
        out = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), decoder_input_ids=given, use_cache=False)
    else:
        out = model(input_ids=given, attention_mask=torch.ones_like(given), use_cache=False)
    first = start_length(model, prompt) - 1
    return out.logits[0, first:].to(dtype=torch.float32)  # as generate widens each step's logits


def forced_tokens(rows: torch.Tensor, sequence: torch.Tensor, start: int, processors) -> list[int]:
    """The tokens a greedy generation with these next-token `rows` picks while it follows `sequence`: its tokens up to
    and including the first that differs from the sequence's (all of them where none differs)."""
    sequence = sequence.to(rows.device)  # where the processors were built (the reference's device)
    want = sequence[0, start:].tolist()
    out = []
    for j, token in enumerate(want):
        ids = sequence[:, :start + j]
        scores = processors(ids, rows[j:j + 1].clone())
        picked = int(torch.argmax(scores, dim=-1))
        out.append(picked)
        if picked != token:
            break
    return out
