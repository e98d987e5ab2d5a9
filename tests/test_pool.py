"""engine.pool: what a streamed pass lets go of is reused by the next read of that size, never while anything else
holds it, and never beside a new allocation."""

from __future__ import annotations

import torch
from torch import nn

from halfsafe.core.forward import logits
from halfsafe.engine.pool import Pool, sole_owner
from halfsafe.engine.streamed import streamed_of
from halfsafe.io.loading import load_model
from tests.tiny import save_tiny, tiny_ids


def test_only_a_tensor_nothing_else_holds_is_kept():
    t = torch.randn(4, 8)
    assert sole_owner(t)
    p = nn.Parameter(t, requires_grad=False)
    assert not sole_owner(t), "a parameter shares its storage"
    del p
    assert sole_owner(t)
    v = t[1:]
    assert not sole_owner(t) and not sole_owner(v), "a view, and the view's base"
    del v
    assert not sole_owner(t[:, :4].contiguous()[:2]), "a part of a storage"
    pool = Pool()
    held = torch.randn(16)
    keep = held.view(4, 4)
    pool.give(held)
    assert pool.held_bytes() == 0 and keep.sum() is not None


def test_take_gives_back_what_fits_and_a_miss_empties_the_pool():
    pool = Pool()
    a, b = torch.randn(4, 8), torch.randn(32)
    mine = {a.data_ptr(), b.data_ptr()}
    pool.give(a)
    pool.give(b)
    del a, b
    got = pool.take((8, 4), torch.float32)  # same size, any shape
    assert got.shape == (8, 4) and got.data_ptr() in mine and pool.reused == 1
    assert pool.take((4, 8), torch.float16) is None, "another dtype: a miss"
    assert pool.held_bytes() == 0, "a miss empties the pool before the caller allocates"


def test_a_streamed_model_reuses_its_blocks_tensors_with_the_same_logits(tmp_path):
    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, stream=True).model
    s = streamed_of(model)
    ids = tiny_ids(model, 8)
    first = logits(model, ids)
    reused = s.shards.pool.reused
    assert reused > 0, "the second block reads into the first block's tensors"
    again = logits(model, ids)
    assert torch.equal(first, again) and s.shards.pool.reused > reused
    s.shards.pool, pool = None, s.shards.pool
    assert torch.equal(logits(model, ids), first), "without the pool: the same logits"
    unit = max(sum(p.numel() * 4 for p in model.get_submodule(u).parameters()) for u in s.units)
    assert pool.held_bytes() <= unit + sum(p.numel() * 4 for n, p in model.named_parameters() if "layers" not in n)


def test_slices_of_a_rescaled_wide_weight_never_pile_up_in_the_pool(tmp_path, monkeypatch):
    """A wide weight with a rescale is read a slice of rows at a time in float32 and cast: those slices are not whole
    reads and must not enter the pool (writing a 7.6B checkpoint once piled up its 2 GB embedding there, a slice at a
    time, since the whole reads in between all found their size and nothing emptied it)."""
    import halfsafe.engine.wide as wide
    from halfsafe.core.weights import MUL

    monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
    monkeypatch.setattr(wide, "CHUNK_BYTES", 1)
    save_tiny("llama", tmp_path)
    s = streamed_of(load_model(tmp_path, stream=True).model)
    s.wide_bytes = 0
    name = "model.embed_tokens.weight"
    s.set_rescale({name: [(MUL, -2, None)]})
    saved = s.set_dtype(torch.float16)
    try:
        assert s._is_wide(name)
        slices = [s.rows(name, a, a + 32) for a in range(0, s.shards.shape(s.key_of[name])[0], 32)]
    finally:
        s.restore_dtype(saved)
    assert all(t.dtype == torch.float16 for t in slices)
    assert s.shards.pool.held_bytes() == 0
