"""Activation statistics against values computed by hand or by numpy: every SiteStats field on known tensors
(in one chunk and in many, with non-finite values, at fp16's exact limits), the sites a collector records on
a hand-built model, where stop_at_nonfinite stops, and the per-expert products of a fused-experts module."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from halfsafe.core import stats
from halfsafe.core.formats import FP16_MAX, FP16_MIN_NORMAL
from halfsafe.core.stats import ActivationCollector, SiteStats, first_tensor, is_fused_experts


def _update(*xs) -> SiteStats:
    s = SiteStats("m:out", "Linear")
    for x in xs:
        s.update(torch.as_tensor(x, dtype=torch.float32))
    return s


def test_percentile_is_the_999th_per_mille_of_all_values_when_few():
    rng = np.random.default_rng(0)
    values = rng.permutation(np.arange(1, 1501, dtype=np.float32)) * rng.choice([-1, 1], 1500)
    s = _update(values)
    # 99.9% of 1500 values is 1498.5: the 1499th smallest |x|, here 1499
    assert s.percentile == 1499.0 and s.abs_max == 1500.0 and s.numel == 1500 and s.nonzero == 1500


def test_percentile_of_one_value_is_that_value():
    assert _update([-3.0]).percentile == 3.0


def test_percentile_of_many_values_reads_a_strided_sample():
    n = 3 * 65536  # target stride 12: the least prime from there is 13, which does not divide the (1-D) width n
    assert stats.sample_stride(n, n) == 13 and stats.sample_stride(3 * 16384, 3 * 16384) == 5  # 3 divides: 5
    s = _update(np.arange(n, dtype=np.float32))
    # x[0], x[13], ...: 15124 values; ceil(15124 * 0.999) = 15109th smallest: 13 * 15108
    assert s.percentile == 13 * 15108 and s.abs_max == n - 1 and s.sampled == 15124 and s.numel == n


def test_the_samples_stride_walks_every_column():
    assert stats.sample_stride(16384, 7) == 1 and stats.sample_stride(4096 * 1024, 1024) == 257  # 256 -> the next prime
    assert stats.sample_stride(44 * 16384, 5632) == 47  # 44 -> 47 (43 and 47 are primes; 5632 = 2^9 * 11)
    assert stats.sample_stride(11 * 16384, 5632) == 13  # 11 divides 5632
    # a massive channel: column 0 of every row is 1e4, the rest N(0, 1). A stride of 256 would sample column 0 in
    # every 4th row (1/4 of the sample) and call 1e4 the 99.9th percentile; the prime stride sees it 1/1024 of the time
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 1e4
    s = SiteStats("m:out", "Linear")
    s.update(x)
    assert s.abs_max == 1e4 and 2.5 < s.percentile < 4.5


def test_underflow_fraction_of_a_big_tensor_is_estimated_from_the_sample():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 1024, generator=g) + 4
    x[torch.rand(x.shape, generator=g) < 0.1] = 1e-6  # 10% below float16's least normal, at random places
    x[torch.rand(x.shape, generator=g) < 0.05] = 0.0  # zeros are not underflow
    s = SiteStats("m:out", "Linear")
    s.update(x)
    assert s.numel == x.numel() and s.sampled == len(range(0, x.numel(), 257))
    exact = float(((x.abs() < FP16_MIN_NORMAL) & (x != 0)).sum() / (x != 0).sum())
    assert abs(s.underflow_fraction - exact) < 0.01  # 16321 samples: a standard error of 0.0024


def test_counts_at_float16s_exact_limits():
    tiny = FP16_MIN_NORMAL
    x = [FP16_MAX, -70000.0, 80000.0, tiny, -tiny / 2, tiny / 4, 0.0, 0.0, 1.0]
    s = _update(x)
    assert s.abs_max == 80000.0 and s.above_fp16_max == 2  # 65504 itself fits
    assert s.below_fp16_min_normal == 2  # tiny itself is normal; zeros are not underflow
    assert s.nonzero == 7 and s.numel == 9 and s.nonfinite == 0
    assert s.underflow_fraction == 2 / 7
    assert s.headroom_bits == math.log2(65504 / 80000)


def test_updates_and_chunks_accumulate(monkeypatch):
    monkeypatch.setattr(stats, "_CHUNK", 3)  # 7 values: chunks of 3, 3, 1
    x = [0.0, 2.0, 0.0, 1e5, 3e-6, 0.0, -4.0]
    s = _update(x, [0.0, 5e-6, -7e4])
    assert s.numel == 10 and s.nonzero == 6 and s.abs_max == 1e5
    assert s.above_fp16_max == 2 and s.below_fp16_min_normal == 2  # 1e5 in one chunk, -7e4 in another
    # the percentile is the largest of the chunks' own: chunk [1e5, 3e-6, 0] gives 1e5
    assert s.percentile == pytest.approx(1e5)
    one = _update(x)
    assert one.numel == 7 and one.nonzero == 4 and one.below_fp16_min_normal == 1


def test_non_finite_values_are_counted_and_left_out_of_the_rest():
    s = _update([math.inf, -math.inf, math.nan, 3.0, 0.0, 2e-6])
    assert s.nonfinite == 3 and s.abs_max == math.inf and s.headroom_bits == -math.inf
    assert s.numel == 3 and s.nonzero == 2 and s.below_fp16_min_normal == 1 and s.above_fp16_max == 0
    assert s.percentile == 3.0
    s.update(torch.tensor([5.0, math.nan]))
    assert s.nonfinite == 4 and s.numel == 4 and s.nonzero == 3 and s.abs_max == math.inf and s.percentile == 5.0
    s.update(torch.tensor([math.nan, math.inf]))  # nothing finite
    assert s.nonfinite == 6 and s.numel == 4 and s.nonzero == 3 and s.percentile == 5.0
    one = _update([math.inf, 7.0])  # one finite value: still counted
    assert one.nonfinite == 1 and one.numel == 1 and one.nonzero == 1 and one.percentile == 7.0


def test_to_dict_names_every_field():
    s = _update([1.0, -256.0, 3e-6, 0.0])
    assert s.to_dict() == {
        "name": "m", "site": "m:out", "class": "Linear", "abs_max": 256.0, "p99.9": 256.0, "above_fp16_max": 0,
        "underflow_fraction": 1 / 3, "headroom_bits": math.log2(65504 / 256), "nonfinite": 0,
    }


def test_first_tensor_finds_the_first_floating_tensor():
    f = torch.tensor([2.0])
    assert first_tensor(torch.tensor([1, 2])) is None
    assert first_tensor(f) is f
    assert first_tensor((torch.tensor([1]), [None, f], torch.tensor([3.0]))) is f
    assert first_tensor({"ids": torch.tensor([1]), "x": f}) is f
    assert first_tensor("text") is None and first_tensor(()) is None


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(2, 2), _Double())
        self.head = nn.Linear(2, 1)
        with torch.no_grad():
            self.block[0].weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
            self.block[0].bias.zero_()
            self.head.weight.copy_(torch.tensor([[1.0, -1.0]]))
            self.head.bias.zero_()

    def forward(self, x):
        return self.head(self.block(x))


def test_collector_records_leaf_inputs_and_every_output_in_order_then_lets_go():
    net = _Net()
    x = torch.tensor([[1.0, 2.0]])  # block.0: [5, 11]; doubled: [10, 22]; head: 10 - 22 = -12
    with ActivationCollector(net) as c:
        net(x)
    got = {k: (s.module_class, s.abs_max, s.numel) for k, s in c.sites.items()}
    assert list(got.items()) == [
        ("block.0:in", ("Linear", 2.0, 2)), ("block.0:out", ("Linear", 11.0, 2)),
        ("block.1:in", ("_Double", 11.0, 2)), ("block.1:out", ("_Double", 22.0, 2)),
        ("block:out", ("Sequential", 22.0, 2)),
        ("head:in", ("Linear", 22.0, 2)), ("head:out", ("Linear", 12.0, 1)),
    ]
    assert c.first_nonfinite is None
    net(2 * x)  # the hooks are gone
    assert c.sites["head:out"].abs_max == 12.0 and c.sites["head:out"].numel == 1 and not c._handles


def test_a_site_seen_twice_accumulates():
    net = _Net()
    with ActivationCollector(net) as c:
        net(torch.tensor([[1.0, 2.0]]))
        net(torch.tensor([[0.5, 0.0]]))  # block.0: [0.5, 1.5]; head: 1 - 3 = -2
    assert (c.sites["head:out"].abs_max, c.sites["head:out"].numel) == (12.0, 2)
    assert (c.sites["block.0:in"].abs_max, c.sites["block.0:in"].numel, c.sites["block.0:in"].nonzero) == (2.0, 4, 3)


class _Blow(nn.Module):
    def forward(self, x):
        return x * torch.tensor([math.inf, 1.0])


def test_stop_at_nonfinite_names_the_first_non_finite_output_and_records_nothing():
    net = nn.Sequential(nn.Linear(2, 2), _Blow(), nn.Linear(2, 2))
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(2))
        net[0].bias.zero_()
    with ActivationCollector(net, stop_at_nonfinite=True) as c:
        net(torch.tensor([[1.0, 2.0]]))
    # 1:out is the first non-finite output; 2:in reads it (an input does not count), 2:out is later
    assert c.first_nonfinite == "1:out" and c.sites == {}


class _FusedExperts(nn.Module):
    """transformers' fused-experts layout: gate_up_proj [E, H, 2I] (transposed), [gate; up] concatenated."""

    def __init__(self, w):
        super().__init__()
        self.gate_up_proj = nn.Parameter(w)
        self.is_transposed = True

    def _apply_gate(self, h):
        gate, up = h.chunk(2, dim=-1)
        return gate * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states * 2


class _Moe(nn.Module):
    def __init__(self, w, by_keyword: bool):
        super().__init__()
        self.experts = _FusedExperts(w)
        self.by_keyword = by_keyword

    def forward(self, x, index, weights):
        if self.by_keyword:
            return self.experts(hidden_states=x, top_k_index=index, top_k_weights=weights)
        return self.experts(x, index, weights)


W = torch.tensor([
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]],
    [[100.0, 100.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]],  # expert 1: no token routed to it
    [[-1.0, 0.0, 0.5, 0.0], [0.0, -2.0, 0.0, 0.25]],
])
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
INDEX = torch.tensor([[0, 3], [2, 3], [2, 0]])  # 3: the masked slot (no such expert)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_fused_experts_record_each_routed_experts_gated_product_gate_and_up(by_keyword):
    model = _Moe(W.clone(), by_keyword)
    with ActivationCollector(model) as c:
        model(X, INDEX, torch.ones(3, 2))
    # expert 0 reads tokens 0 and 2: h = [1, 2, 3, 4] and [6, 8, 10, 12]; gate * up = [3, 8] and [60, 96]
    # expert 2 reads tokens 1 and 2: h = [0, -2, 0, .25] and [-1, -2, .5, .25]; gate * up = [0, -.5], [-.5, -.5]
    # (a forward pre-hook sees positional arguments only: called by keyword, the module has no ":in" site)
    expected = [] if by_keyword else [("experts:in", 1.0, 6)]
    expected += [
        ("experts:out", 2.0, 6),
        ("experts:expert0", 96.0, 4), ("experts:expert0.gate", 8.0, 4), ("experts:expert0.up", 12.0, 4),
        ("experts:expert2", 0.5, 4), ("experts:expert2.gate", 2.0, 4), ("experts:expert2.up", 0.5, 4),
    ]
    assert [(k, s.abs_max, s.numel) for k, s in c.sites.items()] == expected
    assert {s.module_class for s in c.sites.values()} == {"_FusedExperts"}
    with ActivationCollector(model, stop_at_nonfinite=True) as c:
        model(X, INDEX, torch.ones(3, 2))
    assert c.sites == {} and c.first_nonfinite is None


class _Attrs(nn.Module):
    def __init__(self, w=None, gate=True, transposed=True):
        super().__init__()
        if w is not None:
            self.gate_up_proj = w
        if gate:
            self._apply_gate = lambda h: h
        if transposed:
            self.is_transposed = False


def test_is_fused_experts_needs_a_3d_gate_up_proj_its_gate_and_layout():
    assert is_fused_experts(_Attrs(torch.zeros(2, 3, 4)))
    assert not is_fused_experts(_Attrs(torch.zeros(3, 4)))
    assert not is_fused_experts(_Attrs(torch.zeros(2, 3, 4, 5)))
    assert not is_fused_experts(_Attrs(torch.zeros(2, 3, 4), gate=False))
    assert not is_fused_experts(_Attrs(torch.zeros(2, 3, 4), transposed=False))
    assert not is_fused_experts(_Attrs(None))
    assert not is_fused_experts(_Attrs(None, gate=False))
    assert not is_fused_experts(_Attrs(torch.zeros(3, 4), gate=False))
    assert not is_fused_experts(nn.Linear(2, 2))


def test_a_tensor_seen_at_several_sites_is_summarised_once_and_counted_at_each():
    x = torch.randn(4, 8)
    seen = stats.SeenTensors()
    first = seen.summaries(x)
    assert seen.summaries(x) is first  # the same tensor, unchanged: its summaries again
    y = x.clone()
    assert seen.summaries(y) is not first and seen.summaries(y) == first  # another tensor: summarised itself
    x.mul_(2)  # changed in place: summarised again
    again = seen.summaries(x)
    assert again is not first and again[0].abs_max == 2 * first[0].abs_max
    for t in (torch.randn(3) for _ in range(3)):  # three others since: x has left
        seen.summaries(t)
    assert seen.summaries(x) is not again


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("key", ["llama", "gemma3_text", "gpt2", "t5", "qwen3_moe", "bert"])
def test_summarising_each_tensor_once_records_what_every_site_alone_records(key):
    from tests.tiny import make_tiny, tiny_ids

    model = make_tiny(key)
    ids = tiny_ids(model, 24)
    from halfsafe.core.forward import run_for_stats

    with ActivationCollector(model) as shared:
        run_for_stats(model, ids)
    with ActivationCollector(model, _seen=stats.SeenTensors(0)) as alone:
        run_for_stats(model, ids)
    assert list(shared.sites) == list(alone.sites)
    assert [s.to_dict() | {"numel": s.numel, "nonzero": s.nonzero} for s in shared.sites.values()] == \
        [s.to_dict() | {"numel": s.numel, "nonzero": s.nonzero} for s in alone.sites.values()]
