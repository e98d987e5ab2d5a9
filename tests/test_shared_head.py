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


def _per_lane_head_stats(model, samples, monkeypatch) -> dict:
    """`scan.collect` on `samples`, shared head and all, with each record at the head's sites also kept under the lane
    it was recorded as (the collector merges lanes; what a lane is, is the sample it claims the values for)."""
    from collections import defaultdict

    from halfsafe.core.lanes import lane
    from halfsafe.core.stats import ActivationCollector, SiteStats

    module = SharedHead.of(model, samples).module
    heads = {f"{module}:in", f"{module}:out"}
    lanes: dict = defaultdict(dict)
    real = ActivationCollector.record

    def record(self, site, mod, t):
        if site in heads:
            stats = lanes[lane()].setdefault(site, SiteStats(site, type(mod).__name__))
            stats.update(t)
        return real(self, site, mod, t)

    with monkeypatch.context() as m:
        m.setattr(ActivationCollector, "record", record)
        _collect(model, samples, True, monkeypatch)
    return dict(lanes)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_each_samples_head_output_is_recorded_as_its_own_lane(wide_head, monkeypatch, kind):
    """The shared head multiplies every sample's hidden state by each slice of rows: every product must be recorded
    as the lane of the sample it came from. Samples of different lengths and contents (each with its own peak and
    count at the head): each lane's statistics at the head's sites are those of that sample scanned alone, which
    calls its own head."""
    model = wide_head(kind)
    samples = [tiny_ids(model, n, seed=i) for i, n in enumerate((40, 23, 57))]
    module = SharedHead.of(model, samples).module
    reads = _head_reads(monkeypatch, model)
    alone = [_collect(model, [ids], True, monkeypatch) for ids in samples]  # one sample: no shared head
    vocab = model.get_output_embeddings().out_features
    assert len(reads) == sum(-(-ids.shape[-1] // 16) for ids in samples) * -(-vocab // 32)  # each called its own
    reads.clear()
    lanes = _per_lane_head_stats(model, samples, monkeypatch)
    assert len(reads) == -(-vocab // 32), "the head was not shared"
    assert sorted(lanes) == list(range(len(samples))), f"head values recorded as lanes {sorted(lanes)}"
    out = f"{module}:out"
    peaks = [a[out].abs_max for a in alone]
    assert len(set(peaks)) == len(samples) and len({a[out].numel for a in alone}) == len(samples), \
        "the samples must differ at the head for a swap to show"
    for i, a in enumerate(alone):
        got = lanes[i]
        assert all(getattr(got[out], f) == getattr(a[out], f) for f in EXACT), (i, got[out], a[out])
        assert got[f"{module}:in"].to_dict() == a[f"{module}:in"].to_dict(), i  # the chunks its own head was called on


def test_a_sample_is_the_lane_that_computed_when_it_handed_its_hidden_state_over(wide_head):
    """`take` keeps the lane computing now, whatever the order the samples hand over in: each lane's products at
    the head's sites are its own hidden state's, in and out."""
    from collections import defaultdict

    import torch.nn.functional as F

    from halfsafe.core.lanes import lane, set_lane

    model = wide_head("llama")
    recorded = defaultdict(list)
    shared = SharedHead.of(model, [torch.zeros(1, 2), torch.zeros(1, 2)],
                           lambda site, module, t: recorded[lane(), site.rpartition(":")[2]].append(t.clone()))
    width = model.get_output_embeddings().in_features
    g = torch.Generator().manual_seed(0)
    hidden = {i: torch.randn(1, n, width, generator=g) * (i + 1) for i, n in ((0, 20), (1, 7), (2, 33))}
    try:
        for i in (2, 0, 1):  # handed over out of lane order
            set_lane(i)
            shared.take(hidden[i])
    finally:
        set_lane(None)
    shared.run()
    weight = streamed_of(model).original(shared.param)
    assert {k[0] for k in recorded} == set(hidden)
    for i, h in hidden.items():
        assert torch.equal(torch.cat(recorded[i, "in"], dim=1), h), i
        out = torch.cat(recorded[i, "out"], dim=-1)
        assert out.shape == (1, h.shape[1], weight.shape[0]) and torch.allclose(out, F.linear(h, weight), rtol=1e-5, atol=1e-5), i
