"""The safety margin: chosen for a context length by a stated rule, recorded in the plan, halfsafe.json and
the model card; candidates above and below the solver's residual scale, the least fp16 KL among those that
keep the margin; a long calibration sample made from the embedded text."""

from __future__ import annotations

import json
import math

import pytest
from tiny import make_tiny, save_tiny, tiny_ids

import halfsafe.convert as convert
from halfsafe.calibration import default_text, encode, long_sample_ids
from halfsafe.convert import Candidate, candidate_exponents, choose_candidate, convert_checkpoint, keeps_margin, plan_fp16_safe
from halfsafe.core.groups import Group, expand
from halfsafe.core.margin import BASE_MARGIN_BITS, GROWTH_BITS_PER_DOUBLING, choose_margin, margin_bits
from halfsafe.core.plan import Constraint, Plan, solve
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.errors import HalfsafeError
from halfsafe.families import family_for
from halfsafe.requests import MarginOptions
from halfsafe.scan import scan

G = [Group("residual", "residual", None, ())]


def _stress_gemma3(bits_over: float = 2.0):
    """Tiny Gemma 3 whose residual stream peaks about `bits_over` bits above 65504 (untied head, as in
    test_families' stress models)."""
    model = make_tiny("gemma3_text", untie=True)
    ids = tiny_ids(model, length=16)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    peak = max(l.residual_peak for l in scan(model, [ids], progress=False).layers)
    apply_exponents_(model, family, groups, {"residual": math.ceil(math.log2(2 ** bits_over * 65504 / peak))})
    return model, ids


def test_margin_rule_follows_the_context_length():
    config = make_tiny("gemma3_text").config  # max_position_embeddings 128
    assert margin_bits(512, 512) == BASE_MARGIN_BITS
    assert margin_bits(32768, 512) == pytest.approx(BASE_MARGIN_BITS + 6 * GROWTH_BITS_PER_DOUBLING)
    m = choose_margin(config, calibrated_tokens=16)
    assert m.context_length == 128 and m.bits == pytest.approx(BASE_MARGIN_BITS + 3 * GROWTH_BITS_PER_DOUBLING)
    longer = choose_margin(config, calibrated_tokens=16, max_context=1 << 16)
    assert longer.context_length == 1 << 16 and longer.bits == pytest.approx(BASE_MARGIN_BITS + 12 * GROWTH_BITS_PER_DOUBLING)
    assert longer.bits > m.bits  # a longer context asks for more
    assert choose_margin(config, 16, max_context=1 << 16, headroom_bits=2.5).bits == 2.5  # an explicit margin wins
    with pytest.raises(HalfsafeError, match="--max-context"):  # checked where it is asked for, once
        MarginOptions(max_context=0)


def test_max_context_sets_the_plan_margin_and_residual_scale():
    model, ids = _stress_gemma3()
    short = plan_fp16_safe(model, [ids], progress=False, max_context=16)
    long = plan_fp16_safe(model, [ids], progress=False, max_context=16 << 30)  # 30 doublings: a margin ~3 bits larger
    assert short.plan.context_length == 16 and short.plan.headroom_bits == pytest.approx(BASE_MARGIN_BITS)
    assert long.plan.context_length == 16 << 30
    assert long.plan.headroom_bits == pytest.approx(BASE_MARGIN_BITS + 30 * GROWTH_BITS_PER_DOUBLING)
    def largest_kept(report):
        return max(c.residual_exponent for c in report.candidates if c.keeps_margin)

    assert largest_kept(long) < largest_kept(short)  # more margin: larger scales no longer qualify
    assert long.plan.exponents["residual"] <= largest_kept(long)
    for report in (short, long):
        assert report.chosen.keeps_margin and report.chosen.headroom_bits >= report.plan.headroom_bits - 1e-9


def test_candidates_include_larger_scales_and_only_those_keeping_the_margin_count():
    cons = [Constraint("layer:out", 17.0, {"residual": 1})]
    best = solve(G, cons, headroom_bits=1)
    assert best["residual"] == -3  # 2**17 / 8 = 16384 <= 65504 / 2 < 2**17 / 4
    cands = candidate_exponents(G, cons, 1, n=3)
    assert [c["residual"] for c in cands] == [-1, -2, -3, -4, -5]  # two above the solver's, two below
    kept = {c["residual"]: keeps_margin(cons, c, best, 1) for c in cands}
    assert [r for r, (k, _) in kept.items() if k] == [-3, -4, -5]
    assert kept[-3][1] == pytest.approx(math.log2(65504) - 14)  # bits left on the peak
    assert kept[-2] == (False, pytest.approx(math.log2(65504) - 15))

    def cand(r, kl, keeps):
        return Candidate({"residual": r}, kl, 1.0, True, math.log2(65504) - 17 - r, keeps)

    # the least KL overall breaks the margin: not chosen; among the rest the least KL wins, not the first
    tried = [cand(-2, 1e-6, False), cand(-3, 3e-6, True), cand(-4, 2e-6, True), cand(-5, 4e-6, True)]
    assert choose_candidate(tried).residual_exponent == -4
    tried[2].finite = False
    assert choose_candidate(tried).residual_exponent == -3


def test_search_on_a_model_runs_larger_scales_and_picks_the_least_kl_that_keeps_the_margin(monkeypatch):
    model, ids = _stress_gemma3()
    kl_by_residual = {}
    real = convert.evaluate_candidate

    def fake_kl(model, family, groups, exponents, ids, ref, arith="native"):  # a measured run, with a KL that favours 2 steps down
        c = real(model, family, groups, exponents, ids, ref, arith)
        r = exponents["residual"]
        c.kl = 1e-6 * (1 + abs(r - (best - 1)))
        kl_by_residual[r] = c.kl
        return c

    calibration = plan_fp16_safe(model, [ids], progress=False, headroom_bits=1.0)
    best = max(c.residual_exponent for c in calibration.candidates if c.keeps_margin)
    monkeypatch.setattr("halfsafe.convert.candidates.evaluate_candidate", fake_kl)  # where the step calls it
    report = plan_fp16_safe(model, [ids], progress=False, headroom_bits=1.0)
    residuals = [c.residual_exponent for c in report.candidates]
    assert max(residuals) > best  # a scale above the solver's was considered ...
    assert all(not c.keeps_margin and math.isnan(c.kl) for c in report.candidates if c.residual_exponent > best)  # ... not run
    assert set(kl_by_residual) == {r for r in residuals if r <= best}
    assert report.plan.exponents["residual"] == best - 1  # the least KL among the kept ones
    # with 2 bits the solver's own choice is one step lower, and 2^(best) is "above" it: kept at 1 bit, not at 2
    strict = plan_fp16_safe(model, [ids], progress=False, headroom_bits=2.0)
    assert max(c.residual_exponent for c in strict.candidates if c.keeps_margin) == best - 1


def test_long_sample_has_the_requested_length_and_comes_from_the_calibration_text():
    base = encode(default_text(), None, 256)  # 22k bytes
    x = long_sample_ids(None, 256, 50000)
    assert x.shape == (1, 50000)
    assert x[0, : len(base)].tolist() == base and x[0, len(base) : 50000].tolist() == (base * 2)[: 50000 - len(base)]

    class Tok:
        bos_token_id = 2

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 250 + 3 for c in text]}

    y = long_sample_ids(Tok(), 256, 30000)
    assert y.shape == (1, 30000) and y[0, 0] == 2 and (y[0, 1:] != 2).all()
    with pytest.raises(HalfsafeError, match="--long-sample"):
        long_sample_ids(None, 256, 1)


def test_halfsafe_json_and_model_card_state_context_and_margin(tmp_path):
    src = save_tiny("gemma3_text", tmp_path / "tiny")
    out = tmp_path / "out"
    report = convert_checkpoint(str(src), str(out), seq_len=32, max_samples=2, progress=False, max_context=4096, long_sample=64)
    info = json.loads((out / "halfsafe.json").read_text())
    assert report.margin.calibrated_tokens == 64  # the long sample counts
    expected = margin_bits(4096, 64)
    assert info["plan"]["context_length"] == 4096 and info["plan"]["headroom_bits"] == pytest.approx(expected)
    assert info["margin"]["context_length"] == 4096 and info["margin"]["calibrated_tokens"] == 64
    assert "bench/fidelity/context_study.py" in info["margin"]["rule"]
    assert Plan.load(out / "halfsafe.json").context_length == 4096
    card = (out / "README.md").read_text()
    assert f"margin: {expected:.2f} bits under 65504, made for contexts up to 4096 tokens" in card
    cands = info["candidates"]
    assert any("keeps_margin" in c and "headroom_bits" in c for c in cands)


@pytest.mark.parametrize("option, match", [({"max_context": 0}, "--max-context"), ({"long_sample": 1}, "--long-sample"),
                                           ({"headroom_bits": -1}, "--headroom-bits")])
def test_bad_margin_options_fail_before_loading(tmp_path, option, match):
    with pytest.raises(HalfsafeError, match=match):
        convert_checkpoint(str(tmp_path / "no-such-model"), str(tmp_path / "out"), **option)
