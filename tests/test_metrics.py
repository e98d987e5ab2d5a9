"""The numbers halfsafe reports, checked against values computed by hand (or by numpy) on known tensors:
KL direction, top-1, shifted NLL and perplexity, greedy prefixes, non-finite counts, max error, and every
activation statistic scan reports."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from halfsafe.convert import storage_error
from halfsafe.core import stats
from halfsafe.core.formats import FP16_MAX, FP16_MIN_NORMAL
from halfsafe.core.metrics import kl_per_token, mean_kl, top1_agreement
from halfsafe.core.stats import PERCENTILE, SiteStats
from halfsafe.verify import _Accumulator, _matched_prefix, _nll_sum


def _logits(*rows: list[float]) -> torch.Tensor:
    """[1, positions, vocab] logits whose softmax is exactly the given probabilities."""
    return torch.tensor(rows, dtype=torch.float64).log()[None]


P = [0.9, 0.1]
Q = [0.5, 0.5]
KL_P_Q = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # 0.3681 nats
KL_Q_P = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108 nats: the direction matters


def test_kl_is_reference_to_variant_per_position():
    kl = kl_per_token(_logits(P, Q), _logits(Q, Q))
    assert kl.tolist() == pytest.approx([KL_P_Q, 0.0], abs=1e-12)
    assert mean_kl(_logits(P), _logits(Q)) == pytest.approx(KL_P_Q, abs=1e-12)
    assert mean_kl(_logits(Q), _logits(P)) == pytest.approx(KL_Q_P, abs=1e-12)
    # an additive shift of the logits is the same distribution
    assert mean_kl(_logits(P), _logits(P) + 7.0) == pytest.approx(0.0, abs=1e-12)


def test_kl_of_non_finite_logits_is_nan():
    bad = _logits(Q).clone()
    bad[0, 0, 1] = math.inf
    assert math.isnan(mean_kl(_logits(P), bad))


def test_top1_agreement_counts_positions_whose_argmax_matches():
    ref = torch.tensor([[[0.0, 1, 2], [3, 0, 0], [0, 5, 1], [1, 0, 0]]])
    out = torch.tensor([[[0.0, 0, 9], [0, 4, 0], [0, 5, 1], [0, 0, 2]]])  # positions 0 and 2 agree
    assert top1_agreement(ref, out) == 0.5
    assert top1_agreement(ref, ref) == 1.0


def test_nll_predicts_the_next_token_for_causal_models_and_the_same_token_for_decoders():
    # vocab 3, ids [0, 1, 2]: position i holds the probabilities of the token at i+1 (causal)
    probs = [[0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]
    logits = _logits(*probs)
    ids = torch.tensor([[0, 1, 2]])
    total, n = _nll_sum(logits, ids, encoder_decoder=False)
    assert n == 2 and total == pytest.approx(-math.log(0.7) - math.log(0.8), abs=1e-12)
    total, n = _nll_sum(logits, ids, encoder_decoder=True)  # teacher-forced: position i predicts token i
    assert n == 3 and total == pytest.approx(-math.log(0.2) - math.log(0.1) - math.log(0.1), abs=1e-12)


def test_accumulator_metrics_match_hand_computed_values():
    ref = _logits(P, Q, [0.25, 0.75]).float()
    out = _logits(Q, Q, [0.75, 0.25]).float()
    ids = torch.tensor([[1, 0, 1]])
    acc = _Accumulator(lm=True)
    acc.add(ref, out, ids, encoder_decoder=False)
    m = acc.metrics()
    kl3 = 0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25)
    assert m.positions == 3 and m.nonfinite_logits == 0 and m.nonfinite_positions == 0
    assert m.kl_mean == pytest.approx((KL_P_Q + 0 + kl3) / 3, rel=1e-6)
    assert m.top1 == pytest.approx(2 / 3)  # positions 0 and 1 agree on token 0 (a tie picks the first); 2 differs
    # out predicts ids[1] = 0 with 0.5 at position 0 and ids[2] = 1 with 0.5 at position 1
    assert m.perplexity == pytest.approx(math.exp((-math.log(0.5) - math.log(0.5)) / 2), rel=1e-6)
    assert m.max_abs_logit_error == pytest.approx(float((out - ref).abs().max()))
    assert m.max_abs_logit_error == pytest.approx(math.log(0.5 / 0.1), rel=1e-6)  # position 0, token 1
    assert m.greedy_matched is None and m.greedy_total is None


def test_accumulator_counts_non_finite_logits_and_positions_and_merges():
    ref = torch.zeros(1, 4, 5)
    out = torch.zeros(1, 4, 5)
    out[0, 1, 2] = math.nan
    out[0, 1, 3] = math.inf
    out[0, 3, 0] = -math.inf
    acc = _Accumulator(lm=False)
    acc.add(ref, out, torch.zeros(1, 4, dtype=torch.long), encoder_decoder=False)
    m = acc.metrics()
    assert (m.nonfinite_logits, m.nonfinite_positions, m.positions) == (3, 2, 4)
    assert math.isnan(m.max_abs_logit_error) and m.perplexity is None
    other = _Accumulator(lm=False)
    other.add(ref, ref + 0.5, torch.zeros(1, 4, dtype=torch.long), encoder_decoder=False)
    other.add_greedy(3, 8)
    good = other.metrics()
    assert good.max_abs_logit_error == 0.5 and good.top1 == 1.0 and (good.greedy_matched, good.greedy_total) == (3, 8)
    other.add_greedy(8, 8)
    acc.merge(other)
    merged = acc.metrics()
    assert merged.positions == 8 and merged.nonfinite_logits == 3 and merged.greedy_matched == 11
    assert merged.greedy_total == 16 and merged.greedy_fraction == pytest.approx(11 / 16)


def test_greedy_prefix_stops_at_the_first_difference():
    assert _matched_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert _matched_prefix([5, 6], [5, 6]) == 2
    assert _matched_prefix([7], [8]) == 0


# --- scan statistics against numpy -------------------------------------------------------------------------------


def _known_tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40_000, generator=g, dtype=torch.float64) * 1000
    x[:7] = torch.tensor([7e4, -9e4, 65504.0, -65505.0, 0.0, 1e-6, -3e-5], dtype=torch.float64)
    x[100:110] = 0.0
    return x.float()


def test_site_stats_match_numpy(monkeypatch):
    monkeypatch.setattr(stats, "_PERCENTILE_SAMPLE", 1 << 16)  # 40000 values: every one is in the sample
    x = _known_tensor()
    a = np.abs(x.numpy().astype(np.float64))
    s = SiteStats("m:out", "Linear")
    s.update(x.reshape(200, 200))
    assert s.abs_max == a.max() == 9e4
    assert s.above_fp16_max == int((a > FP16_MAX).sum()) == 3  # 65504 itself fits; 65505, 7e4 and 9e4 do not
    nonzero = a > 0
    assert s.nonzero == int(nonzero.sum()) and s.numel == x.numel()
    assert s.below_fp16_min_normal == int((nonzero & (a < FP16_MIN_NORMAL)).sum()) == 2
    assert s.underflow_fraction == pytest.approx(2 / nonzero.sum())
    # with every element in the sample the percentile is the nearest-rank value, rank
    # ceil(n * 99.9 / 100) in exact integer arithmetic (numpy's float rank lands one element higher here)
    assert PERCENTILE == 99.9
    rank = -(-a.size * 999 // 1000)
    assert s.percentile == np.sort(a)[rank - 1]
    assert s.headroom_bits == pytest.approx(math.log2(65504 / 9e4))
    assert s.nonfinite == 0


def test_site_stats_count_non_finite_values_and_merge_updates():
    s = SiteStats("m:out", "Linear")
    s.update(torch.tensor([1.0, 2.0, math.inf, math.nan]))
    assert s.nonfinite == 2 and s.abs_max == math.inf and s.headroom_bits == -math.inf and s.numel == 2
    t = SiteStats("n:in", "Linear")
    t.update(torch.tensor([3.0, -4.0]))
    t.update(torch.tensor([1e5, 0.5]))
    assert t.abs_max == 1e5 and t.above_fp16_max == 1 and t.numel == 4
    assert t.headroom_bits == pytest.approx(math.log2(65504 / 1e5)) and t.headroom_bits < 0
    assert SiteStats("z:out", "X").headroom_bits == math.inf


def test_storage_error_matches_an_independent_computation():
    x = _known_tensor()
    got = storage_error(x, chunk=1000)
    d = x.double()
    rel = float((d.half().double() - d).norm() / d.norm())  # fp16 cast: overflow to inf makes this inf
    h = x.half().double()
    finite = torch.isfinite(h)
    expect = float(((h - d)[finite]).norm() ** 2)
    # 7e4 and -9e4 become inf in fp16: storage_error counts them as overflow; -65505 rounds to -65504 (inf starts
    # at 65520, half a step past 65504)
    assert got["overflow"] == 2 == int(torch.isinf(x.half()).sum())
    assert got["subnormal_or_zero"] == 2
    assert math.isinf(rel) == math.isinf(got["fp16_rel_error"])
    y = x.clamp(-6e4, 6e4)
    got = storage_error(y, chunk=999)
    yd = y.double()
    assert got["fp16_rel_error"] == pytest.approx(float((yd.half().double() - yd).norm() / yd.norm()), rel=1e-6)  # float32 sums of squares
    assert got["overflow"] == 0
    assert expect > 0
