"""engine.shared_head: a streamed model's wide head is read once for every sample of a scan's pass, its output
recorded as each sample's own; every peak and count the same as when each sample calls its head on chunks of
positions (which read the whole head on every call)."""

from __future__ import annotations

import importlib

import pytest
import torch

import halfsafe.core.forward as forward
import halfsafe.engine.shared_head as shared_head
import halfsafe.engine.wide as wide
from halfsafe.engine.shared_head import SharedHead
from halfsafe.engine.streamed import Streamed, streamed_of
from halfsafe.io.loading import load_model
from tests.tiny import save_tiny, tiny_ids

scan = importlib.import_module("halfsafe.scan")
EXACT = ("abs_max", "numel", "above_fp16_max", "nonfinite")  # what every value decides; the rest is sampled


@pytest.fixture
def wide_head(tmp_path_factory, monkeypatch):
    """Loads the tiny model `kind` streamed, its head read a slice of 32 rows at a time, 16 positions a head call."""
    monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
    monkeypatch.setattr(wide, "CHUNK_BYTES", 1)
    monkeypatch.setattr(forward, "HEAD_CHUNK", 16)
    monkeypatch.setattr(forward, "HEAD_CHUNK_BYTES", 1)

    def load(kind: str):
        folder = tmp_path_factory.mktemp(kind) / "m"
        save_tiny(kind, folder)
        model = load_model(str(folder), stream=True, device="cpu").model
        streamed_of(model).wide_bytes = 0
        return model
    return load


def _head_reads(monkeypatch, model) -> list:
    """The rows of the head's weight read, slice by slice, as they are read."""
    reads, real = [], Streamed.rows
    head = SharedHead.of(model, [torch.zeros(1, 2), torch.zeros(1, 2)])
    assert head is not None

    def rows(self, name, start, stop):
        if name == head.param:
            reads.append((start, stop))
        return real(self, name, start, stop)

    monkeypatch.setattr(Streamed, "rows", rows)
    return reads


def _collect(model, samples, shared: bool, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        if not shared:
            m.setattr(scan.SharedHead, "of", classmethod(lambda cls, *a, **k: None))
        return scan.collect(model, samples, progress=False)


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "gemma2", "gemma3_text", "gpt2"])
def test_the_head_is_read_once_a_pass_and_measures_what_each_samples_calls_measured(wide_head, monkeypatch, kind):
    model = wide_head(kind)
    samples = [tiny_ids(model, 40, seed=i) for i in range(3)]  # 3 head calls a sample (16 positions each)
    reads = _head_reads(monkeypatch, model)
    apart = _collect(model, samples, False, monkeypatch)
    per_call = len(reads)
    reads.clear()
    together = _collect(model, samples, True, monkeypatch)
    vocab = model.get_output_embeddings().out_features
    slices = -(-vocab // 32)
    assert per_call == 3 * 3 * slices and len(reads) == slices  # 9 reads of the head, then one
    assert list(together) == list(apart)  # the same sites in the same order (one forward after another)
    head_out = f"{SharedHead.of(model, samples).module}:out"
    for site, s in apart.items():
        t = together[site]
        assert all(getattr(t, f) == getattr(s, f) for f in EXACT), site
        if site != head_out:  # the head's input too: recorded in the chunks it was called on
            assert t.to_dict() == s.to_dict(), site


def test_samples_whose_hidden_states_pass_the_bound_call_their_own_head(wide_head, monkeypatch):
    model = wide_head("llama")
    samples = [tiny_ids(model, 40, seed=i) for i in range(2)]
    width = model.config.hidden_size
    monkeypatch.setattr(shared_head, "HIDDEN_BYTES", 80 * width * 4 - 1)
    assert SharedHead.of(model, samples) is None
    monkeypatch.setattr(shared_head, "HIDDEN_BYTES", 80 * width * 4)
    assert SharedHead.of(model, samples) is not None


def test_only_a_wide_plain_head_of_a_streamed_model_is_shared(wide_head, tmp_path):
    model = wide_head("llama")
    samples = [tiny_ids(model, 8, seed=i) for i in range(2)]
    assert SharedHead.of(model, samples[:1]) is None  # one sample: nothing to share
    streamed_of(model).wide_bytes = 1 << 40
    assert SharedHead.of(model, samples) is None  # a head held whole is read once a pass anyway
    save_tiny("llama", tmp_path / "whole")
    whole = load_model(str(tmp_path / "whole"), stream=False, device="cpu").model
    assert SharedHead.of(whole, samples) is None
