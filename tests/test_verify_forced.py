"""verify's greedy agreement from one teacher-forced forward (halfsafe.verify.forced). On every tiny family that
generates, fp32's forced tokens over its own generation are its generated tokens, and a perturbed copy's forced tokens
are its own token-by-token generation's up to and including the first that differs. In verify only the reference
generates token by token, and every variant's greedy figures are those token-by-token generation gives."""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext

import pytest
import torch
from stress import make_stress
from tiny import TINY, make_tiny, tiny_ids

from halfsafe.calibration import default_text, heldout_text, make_samples
from halfsafe.core.forward import logits
from halfsafe.verify import runner as runner_module
from halfsafe.verify import verify
from halfsafe.verify.accumulator import matched_prefix
from halfsafe.verify.forced import forced_rows, forced_tokens, start_length
from halfsafe.verify.runner import generate, greedy

TOKENS, PROMPT = 8, 8


@torch.no_grad()
def _perturbed(model, seed: int):
    """A copy whose every weight is off by ~30%: its generation leaves the original's somewhere in the first tokens."""
    v = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for p in v.parameters():
        p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return v


@pytest.mark.parametrize("key", sorted(TINY))
def test_forced_tokens_are_what_generation_picks(key):
    model = make_tiny(key)
    if not model.can_generate():
        pytest.skip("does not generate")
    prompt = tiny_ids(model, PROMPT)
    built = []
    sequence = generate(model, prompt, TOKENS, processors=built)
    start = start_length(model, prompt)
    mine = sequence[0, start:].tolist()
    assert len(built) == 1, "generate's logits processors captured"
    assert forced_tokens(forced_rows(model, prompt, sequence), sequence, start, built[0]) == mine
    for seed in (0, 1):
        other = _perturbed(model, seed)
        generated = greedy(other, prompt, TOKENS)
        m = matched_prefix(mine, generated)
        assert forced_tokens(forced_rows(other, prompt, sequence), sequence, start, built[0]) == generated[:m + 1]


def _stressed_llama():
    """A tiny Llama pushed past fp16's range: its fp16 variants overflow and their greedy tokens leave fp32's."""
    model = make_tiny("llama")
    calib = make_samples([default_text()], None, model.config.vocab_size, 24, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    return model


def _greedy_of(report) -> list:
    return [(r.variant.name, r.overall.greedy_matched, r.overall.greedy_total, r.greedy_tokens) for r in report.results]


def test_verify_generates_the_reference_only_and_reports_what_generation_gives(monkeypatch, caplog):
    model = _stressed_llama()
    args = dict(texts=[heldout_text()[:400]], text_names=["a"], seq_len=16, max_samples=2, greedy_tokens=6, prompt_tokens=5)
    calls = []
    real = runner_module._greedy
    monkeypatch.setattr(runner_module, "_greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = verify(model, **args)
    assert len(calls) == 1, "only fp32 generates token by token"
    calls.clear()
    # nothing captured: the self-check fails, it says so, and every variant generates token by token
    monkeypatch.setattr(runner_module, "capturing_processors", lambda m, into: nullcontext())
    with caplog.at_level(logging.WARNING, logger="halfsafe.verify.runner"):
        slow = verify(model, **args)
    assert len(calls) == len(slow.results) and "one by one" in caplog.text
    matched = {name: m for name, m, _, _ in _greedy_of(slow)}
    assert min(matched.values()) < args["greedy_tokens"] == max(matched.values()), matched  # some variants leave fp32
    for (name, m, total, toks), (_, m2, total2, toks2) in zip(_greedy_of(fast), _greedy_of(slow)):
        assert (m, total) == (m2, total2), name
        assert toks == [t[:m2 + 1] for t in toks2], name  # up to and including the first token that differs
