"""verify's greedy generation keeps the model's own KV cache: the prompt runs once, then one token per step (an
encoder-decoder's encoder once), streamed or whole, and the tokens are those of the same generation without a cache
on every tiny family, in float32 and float16 (logits within what one fp16 rounding of the largest logit is)."""

from __future__ import annotations

import math

import pytest
import torch

from halfsafe.engine.precision import in_dtype
from halfsafe.engine.streamed import streamed_of
from halfsafe.io.loading import load_model
from halfsafe.verify import greedy
from tests.tiny import TINY, make_tiny, save_tiny, tiny_ids

TOKENS, PROMPT = 4, 8  # past the tiny Gemmas' sliding window of 8: their sliding and hybrid caches are exercised


def _steps(model: torch.nn.Module):
    """(tokens the decoder is given per forward, encoder runs) while generating: hooks on the model's forward."""
    fed, encoded = [], []

    def seen(module, args, kwargs):
        ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
        fed.append(ids.shape[-1])

    handles = [model.register_forward_pre_hook(seen, with_kwargs=True)]
    if model.config.is_encoder_decoder:
        handles.append(model.get_encoder().register_forward_pre_hook(lambda *a: encoded.append(1)))
    return fed, encoded, handles


@pytest.mark.parametrize("key", sorted(TINY))
def test_cached_tokens_are_the_uncached_ones_fp32_and_fp16(key):
    model = make_tiny(key)
    if not model.can_generate():
        pytest.skip("does not generate")
    model.generation_config.use_cache = False  # a saved generation_config.json may say so: the cache is kept anyway
    prompt = tiny_ids(model, PROMPT)
    for dtype, bound in ((torch.float32, lambda top: 1e-5 * top), (torch.float16, lambda top: 2.0 ** (math.floor(math.log2(top)) - 9))):
        with in_dtype(model, dtype) as m:
            fed, encoded, handles = _steps(m)
            cached, plain = [], []
            try:
                got = greedy(m, prompt, TOKENS, logits=cached)
            finally:
                for h in handles:
                    h.remove()
            want = greedy(m, prompt, TOKENS, use_cache=False, logits=plain)
        first = 1 if model.config.is_encoder_decoder else PROMPT
        assert fed == [first] + [1] * (TOKENS - 1), f"{dtype}: the cache keeps what was run, one new token per step ({fed})"
        if model.config.is_encoder_decoder:
            assert len(encoded) == 1, "the encoder runs once"
        assert got == want, f"{dtype}: {got} != {want}"
        top = max(float(p.abs().max()) for p in plain)
        err = max(float((a - b).abs().max()) for a, b in zip(cached, plain))
        assert err <= bound(top), f"{dtype}: logits differ by {err:.3g} (largest {top:.3g})"  # fp16: <= 2 ulp of the largest


@pytest.mark.parametrize("key", ["llama", "gemma3", "t5"])
def test_streamed_greedy_caches_and_runs_each_block_once_per_token(key, tmp_path):
    """Streamed: the same tokens as the whole model; every decoder block runs (and is read) once per token, an
    encoder's blocks once, and no more is read than one forward per token reads."""
    save_tiny(key, tmp_path / "m")
    whole, streamed = load_model(tmp_path / "m").model, load_model(tmp_path / "m", stream=True).model
    s = streamed_of(streamed)
    prompt = tiny_ids(whole, PROMPT)
    before = s.loads
    greedy(streamed, prompt, 1)
    one_forward = s.loads - before
    runs = {u: 0 for u in s.units if u not in s.stem}
    hooks = [streamed.get_submodule(u).register_forward_pre_hook(lambda *a, u=u: runs.__setitem__(u, runs[u] + 1)) for u in runs]
    fed, encoded, handles = _steps(streamed)
    before = s.loads
    try:
        got = greedy(streamed, prompt, TOKENS)
    finally:
        for h in hooks + handles:
            h.remove()
    assert got == greedy(whole, prompt, TOKENS)
    assert fed[1:] == [1] * (TOKENS - 1) and len(encoded) == (1 if whole.config.is_encoder_decoder else 0)
    decoder = [u for u in runs if ".encoder." not in f".{u}."]
    assert {runs[u] for u in decoder} == {TOKENS}, runs
    assert {runs[u] for u in runs if u not in decoder} <= {0, 1}, runs  # a T5 encoder once; Gemma 3's vision tower never
    assert s.loads - before <= one_forward * TOKENS


def test_resident_keeps_the_weights_only_where_all_of_them_fit(tmp_path):
    """Forwards read the units in the same order each time: a cache that holds them all reads each once, and one that
    holds less would keep nothing until it is needed again, so it is not used (and cannot make a wide matrix whole)."""
    from halfsafe.engine.streamed import resident

    save_tiny("llama", tmp_path / "m")
    streamed = load_model(tmp_path / "m", stream=True).model
    s = streamed_of(streamed)
    ids = tiny_ids(streamed, PROMPT)
    total = s.weight_bytes()
    assert total == sum(p.numel() * 4 for p in load_model(tmp_path / "m").model.parameters())

    def reads_of_second_forward(cache: int) -> int:
        with resident(streamed, cache):
            streamed(ids)
            before = s.loads
            streamed(ids)
            return s.loads - before

    assert reads_of_second_forward(total) == 0
    with resident(streamed, total - 1):
        assert s.cache_bytes == 0
    assert reads_of_second_forward(total - 1) > 0
