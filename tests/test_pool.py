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
