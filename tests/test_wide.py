"""Wide weights (halfsafe.engine.wide): matrices read a slice at a time compute what the whole matrix computes.

Every streamable tiny family runs with every matrix wide (wide_bytes=0) and chunks of 32 rows, so that embeddings,
heads and the blocks' projections all go through the sliced paths, against the model loaded whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import halfsafe.engine.shards as shards_module
import halfsafe.engine.wide as wide
from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.rewrite import apply_exponents_, trial
from halfsafe.core.weights import value_blocks, weights_of
from halfsafe.engine.precision import in_dtype
from halfsafe.engine.streamed import streamed_of
from halfsafe.engine.wide import WideWeight
from halfsafe.families import family_for
from halfsafe.io.checkpoint import save_fp16_checkpoint
from halfsafe.io.loading import load_model
from tests.same_run import assert_same_run
from tests.tiny import make_tiny, random_exponents, save_tiny, streamable, tiny_ids

STREAMABLE = streamable()  # what the engine streams (tests/tiny.loaded_whole)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
    monkeypatch.setattr(wide, "CHUNK_BYTES", 1)


@pytest.fixture(scope="module", params=STREAMABLE)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace("/", "_"))
    save_tiny(request.param, folder)
    streamed = load_model(folder, stream=True).model
    streamed_of(streamed).wide_bytes = 0  # every matrix wide
    return request.param, load_model(folder).model, streamed


def test_every_family_computes_the_whole_models_logits_with_every_matrix_wide(pair, small_chunks):
    key, whole, streamed = pair
    ids = tiny_ids(whole, 12)
    assert_same_run(logits(whole, ids), logits(streamed, ids), "fp32 runs")
    with in_dtype(whole, torch.float16) as a, in_dtype(streamed, torch.float16) as b:
        assert_same_run(logits(a, ids), logits(b, ids), "fp16 runs")
    family = family_for(whole.config.model_type)
    exps = random_exponents(expand(family, whole), seed=3)
    with trial(whole, family, expand(family, whole), exps), trial(streamed, family, expand(family, streamed), exps):
        assert_same_run(logits(whole, ids), logits(streamed, ids), "rescaled runs")


def test_the_usual_paths_never_load_a_wide_matrix_whole(monkeypatch, small_chunks, tmp_path):
    """Lookups read only their rows and linear layers a chunk at a time: the fallback that loads the whole
    matrix is never taken by a standard decoder, an encoder-decoder or Gemma 3 (scaled embedding, tied head)."""
    def refuse(self):
        raise AssertionError(f"{self.param} loaded whole")

    monkeypatch.setattr(WideWeight, "whole", refuse)
    for key in ("llama", "t5", "gemma3_text"):
        save_tiny(key, tmp_path / key)
        streamed = load_model(tmp_path / key, stream=True).model
        s = streamed_of(streamed)
        s.wide_bytes = 0
        read = []
        monkeypatch.setattr(s.shards, "load_rows", lambda k, a, b, d=None, f=s.shards.load_rows, r=read: r.append(b - a) or f(k, a, b, d))
        ids = tiny_ids(streamed, 12)
        logits(streamed, ids)
        embed = streamed.get_input_embeddings().weight
        assert read and max(read) <= 32, "chunks of at most 32 rows"
        assert embed.shape[0] > 32


def test_an_embedding_lookup_reads_only_the_rows_it_needs(tmp_path):
    save_tiny("llama", tmp_path)
    streamed = load_model(tmp_path, stream=True).model
    s = streamed_of(streamed)
    s.wide_bytes = 0
    asked = []
    real = s.shards.load_index
    s.shards.load_index = lambda key, rows, dtype=None: asked.append(rows.tolist()) or real(key, rows, dtype)
    ids = torch.tensor([[7, 3, 7, 200, 4, 5, 6, 3]])
    logits(streamed, ids)
    assert asked == [[3, 4, 5, 6, 7, 200]], "each distinct id once, sorted"


def test_shards_read_rows_and_lists_of_rows_as_the_whole(tmp_path, monkeypatch):
    from halfsafe.engine.shards import Shards

    make_tiny("llama").to(torch.bfloat16).save_pretrained(tmp_path)  # stored in bf16, read in float32 or as stored
    s = Shards(tmp_path)
    key = next(k for k in s.keys() if "embed" in k)
    assert s.dtype(key) == torch.bfloat16
    whole = s.load(key, torch.float32)
    assert torch.equal(s.load_rows(key, 5, 40, torch.float32), whole[5:40])
    rows = torch.tensor([0, 1, 2, 4, 9, 10, 12, 200, 255])  # runs, single rows, and rows two apart
    assert torch.equal(s.load_index(key, rows, torch.float32), whole[rows])
    assert s.load_index(key, torch.tensor([], dtype=torch.long), torch.float32).shape == (0, whole.shape[1])
    monkeypatch.setattr(shards_module, "READ_BYTES", 1000)  # a large tensor is read in blocks of rows
    for dtype in (torch.float32, None, torch.float16):
        got = s.load(key, dtype)
        assert got.dtype == (dtype or torch.bfloat16) and torch.equal(got, whole.to(got.dtype)), dtype


def test_wide_weights_write_the_same_bytes_as_the_whole_model(tmp_path, small_chunks):
    for key in ("gemma3_text", "t5"):
        save_tiny(key, tmp_path / key)
        whole = load_model(tmp_path / key).model
        streamed = load_model(tmp_path / key, stream=True).model
        streamed_of(streamed).wide_bytes = 0
        family = family_for(whole.config.model_type)
        exps = random_exponents(expand(family, whole), seed=5, choices=(-2, -1, 1))
        apply_exponents_(whole, family, expand(family, whole), exps)
        apply_exponents_(streamed, family, expand(family, streamed), exps)
        save_fp16_checkpoint(whole, None, tmp_path / f"{key}-whole", None)
        save_fp16_checkpoint(streamed, None, tmp_path / f"{key}-wide", None)
        a, b = (Path(tmp_path / f"{key}-{m}/model.safetensors").read_bytes() for m in ("whole", "wide"))
        assert a == b, key


def test_weights_read_in_blocks_of_rows_are_the_whole_value(tmp_path, monkeypatch):
    monkeypatch.setattr(shards_module, "READ_BYTES", 2000)
    save_tiny("gemma3_text", tmp_path)
    whole = load_model(tmp_path).model
    streamed = load_model(tmp_path, stream=True).model
    family = family_for(whole.config.model_type)
    exps = random_exponents(expand(family, whole), seed=2)
    with trial(streamed, family, expand(family, streamed), exps), trial(whole, family, expand(family, whole), exps):
        values = weights_of(streamed).values()
        for name, p in whole.named_parameters():
            blocks = list(value_blocks(values, name))
            assert torch.equal(torch.cat(blocks) if p.dim() else blocks[0], p.detach()), name
            if p.dim() == 2 and p.numel() * 4 > 2000:
                assert len(blocks) > 1, name


def test_a_wide_weight_reports_its_parameters_shape_and_falls_back_to_the_whole(tmp_path):
    save_tiny("llama", tmp_path)
    whole = load_model(tmp_path).model
    streamed = load_model(tmp_path, stream=True).model
    s = streamed_of(streamed)
    s.wide_bytes = 0
    name = "model.embed_tokens.weight"
    w = s.tensor(name)
    p = dict(whole.named_parameters())[name]
    assert isinstance(w, WideWeight) and w.shape == p.shape and w.dtype == torch.float32 and w.dim() == 2
    assert torch.equal(w * 2, p.detach() * 2), "any other use computes with the whole matrix"
    assert torch.equal(w[2:4], p.detach()[2:4])
    whole = WideWeight.whole
    WideWeight.whole = lambda self: (_ for _ in ()).throw(AssertionError("one row loads one row"))
    try:
        for index in (5, -1, (7, slice(None)), w.shape[0] - 1, -w.shape[0]):
            assert torch.equal(w[index], p.detach()[index]), index
    finally:
        WideWeight.whole = whole
    with pytest.raises(IndexError):
        w[w.shape[0]]  # past the end: torch's own error, from the whole matrix
    s.set_rescale({})
    s.cache_bytes = 10**9
    assert not isinstance(s.tensor(name), WideWeight), "a tensor the cache may hold is loaded whole"


def test_functional_calls_by_keyword_and_the_fallbacks(tmp_path, small_chunks):
    import torch.nn.functional as F

    save_tiny("llama", tmp_path)
    whole = dict(load_model(tmp_path).model.named_parameters())
    s = streamed_of(load_model(tmp_path, stream=True).model)
    s.wide_bytes = 0
    up, embed = s.tensor("model.layers.0.mlp.up_proj.weight"), s.tensor("model.embed_tokens.weight")
    p_up, p_embed = whole["model.layers.0.mlp.up_proj.weight"].detach(), whole["model.embed_tokens.weight"].detach()
    assert up.shape[0] > 32, "several chunks"
    x, ids, bias = torch.randn(2, 5, up.shape[1]), torch.tensor([[1, 9, 9, 4]]), torch.randn(up.shape[0])
    loaded = s.loads
    assert torch.equal(F.linear(x, weight=up), F.linear(x, p_up))
    assert torch.equal(F.linear(input=x, weight=up, bias=bias), F.linear(x, p_up, bias))
    assert torch.equal(F.embedding(input=ids, weight=embed), F.embedding(ids, p_embed))
    assert s.loads - loaded == up.shape[0] // 32 * 2 + 1, "chunks and one lookup, nothing whole"
    assert torch.equal(F.embedding(ids, embed, max_norm=0.1), F.embedding(ids, p_embed.clone(), max_norm=0.1)), \
        "max_norm renormalises rows in place: computed on the whole matrix"
    assert torch.equal(F.embedding(ids, embed, None, 0.1), F.embedding(ids, p_embed.clone(), None, 0.1)), "max_norm given by position"
    assert up.size(dim=1) == p_up.size(1) and len(up) == len(p_up) and up.dim() == 2 and up.is_floating_point()
    with torch._C.DisableTorchFunctionSubclass():  # an op that reaches dispatch computes with the whole matrix
        assert torch.equal(torch.add(up, 1), p_up + 1)
