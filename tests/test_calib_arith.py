"""The calibration in bfloat16 products (halfsafe.engine.calib_arith, `convert --calib-arith`): its peaks lie within
PEAK_RTOL of float32's on every tiny family, the plan convert chooses from them is float32's on every tiny family
made to overflow (tests/stress.py), convert calibrates again in float32 where a decision sits within PEAK_RTOL of
its limit (on this commit 6 of the 38 stressed families that calibrate in bfloat16: bart, gpt_neox and its two
variants, roberta, umt5; their residual exponent moves within 3% of a peak), "auto" takes bfloat16
only where this CPU's bfloat16 products are measured faster, and halfsafe.json records the choice."""

from __future__ import annotations

import json
import math

import pytest
import torch

from halfsafe.cli import main
from halfsafe.convert import holds_within, plan_with, routes_tokens
from halfsafe.core.forward import logits
from halfsafe.core.groups import Group
from halfsafe.core.plan import Constraint
from halfsafe.engine import calib_arith
from halfsafe.errors import HalfsafeError
from halfsafe.requests import PlanOptions
from halfsafe.scan import collect
from tests.stress import make_stress
from tests.tiny import TINY, make_tiny, save_tiny, tiny_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


def _samples(model):
    return [tiny_ids(model, 48, seed=s) for s in (1, 2)]


def _per_expert(model) -> bool:
    return routes_tokens(model)


@pytest.mark.parametrize("key", sorted(TINY))
def test_bfloat16_products_move_every_peak_less_than_the_tolerance(key):
    model = make_tiny(key)
    if _per_expert(model):  # a rounding may reroute a token (gemma4_text-moe: 3.6%): convert calibrates these in float32
        assert plan_with(model, _samples(model), PlanOptions.checked(calib_arith="bfloat16"),
                         progress=False).calib_arith["used"] == "float32"
        return
    samples = _samples(model)
    exact = collect(model, samples, progress=False)
    with calib_arith.calib_arith(calib_arith.BFLOAT16) as mode:
        rounded = collect(model, samples, progress=False)
    assert mode.calls > 0, "no matrix product ran from bfloat16 operands"
    assert rounded.keys() == exact.keys()
    for site, s in exact.items():
        a, b = s.abs_max, rounded[site].abs_max
        assert math.isfinite(b) and abs(b - a) <= calib_arith.PEAK_RTOL * a, f"{key} {site}: {b} against float32's {a}"


@pytest.mark.parametrize("key", sorted(TINY))
def test_the_plan_from_a_bfloat16_calibration_is_float32s_on_every_tiny_family(key):
    model = make_tiny(key)
    samples = _samples(model)
    make_stress(model, lambda: [logits(model, ids) for ids in samples])  # overflowing: plans with exponents to choose
    plans = {a: plan_with(model, samples, PlanOptions.checked(calib_arith=a, allow_unfixable=True), progress=False)
             for a in ("float32", "bfloat16")}
    exact, rounded = plans["float32"], plans["bfloat16"]
    assert rounded.calib_arith["used"] == ("float32" if _per_expert(model) else "bfloat16")
    assert exact.calib_arith["used"] == "float32"
    assert rounded.plan == exact.plan
    assert [c.exponents for c in rounded.candidates] == [c.exponents for c in exact.candidates]
    assert [c.kl for c in rounded.candidates] == [c.kl for c in exact.candidates]  # the same fp16 trials ran


def test_a_peak_near_a_limit_is_measured_again_in_float32():
    groups = [Group("g", "residual", None, ())]
    limit = math.log2(65504) - 1  # one bit of headroom
    far = [Constraint("a:out", limit + 2.5, {"g": 1}), Constraint("weight:w", 0.0, {"g": 1})]
    near = [Constraint("a:out", limit + 2.0 + 0.01, {"g": 1}), Constraint("weight:w", 0.0, {"g": 1})]
    assert holds_within(groups, far, 1.0, 3)
    assert not holds_within(groups, near, 1.0, 3)  # 1% over a power of two: 2^-3 or 2^-2 by a bfloat16 rounding
    weight_only = [Constraint("weight:w", limit + 2.0 + 0.01, {"g": 1})]
    assert holds_within(groups, weight_only, 1.0, 3), "a weight's peak is exact: it never asks for float32"


def test_convert_calibrates_again_in_float32_where_the_plan_sits_at_a_limit(monkeypatch):
    model = make_tiny("llama")
    samples = _samples(model)
    monkeypatch.setattr("halfsafe.convert.calibrate.holds_within", lambda *a, **k: False)
    report = plan_with(model, samples, PlanOptions.checked(calib_arith="bfloat16"), progress=False)
    exact = plan_with(model, samples, PlanOptions.checked(calib_arith="float32"), progress=False)
    assert "float32_again" in report.calib_arith and report.plan == exact.plan
    assert report.scan_before.peak.abs_max == exact.scan_before.peak.abs_max  # the float32 scan's peaks are the ones kept


def test_auto_takes_bfloat16_only_where_its_products_are_measured_faster(monkeypatch):
    model = make_tiny("llama")
    monkeypatch.setattr(calib_arith, "bfloat16_products_speedup", lambda: 0.25)  # no AVX512-BF16 (this Intel Xeon)
    slow = calib_arith.resolve(None, model)
    assert slow["asked"] == "auto" and slow["used"] == "float32"
    monkeypatch.setattr(calib_arith, "bfloat16_products_speedup", lambda: 1.2)
    assert calib_arith.resolve(None, model) == slow, "halfsafe.json records the choice, never the timing it came from"
    monkeypatch.setattr(calib_arith, "bfloat16_products_speedup", lambda: 4.2)  # AVX512-BF16 (an AMD EPYC's 334 vs 80 GFLOP/s)
    fast = calib_arith.resolve(None, model)
    assert fast["used"] == "bfloat16" and "4.2" not in fast["why"]
    assert calib_arith.resolve("float32", model) == {"asked": "float32", "used": "float32", "why": "asked for"}
    assert calib_arith.resolve("bfloat16", model)["used"] == "bfloat16"
    with pytest.raises(HalfsafeError, match="--calib-arith"):
        PlanOptions.checked(calib_arith="fp8")


def test_bfloat16_products_round_only_float32_cpu_matrix_products():
    x, w, b = torch.randn(4, 64), torch.randn(32, 64), torch.randn(32)
    with calib_arith.calib_arith(calib_arith.BFLOAT16) as mode:
        y = torch.nn.functional.linear(x, w, b)
        again = torch.nn.functional.linear(x, w, b)  # the weight's rounding comes from the cache
        h = x.half() @ w.half().t()  # float16 stays PyTorch's own
        s = torch.softmax(x, -1)
    assert mode.calls == 2 and y.dtype == torch.float32 and h.dtype == torch.float16 and torch.equal(s, torch.softmax(x, -1))
    expect = (x.bfloat16() @ w.bfloat16().t()).float() + b
    assert torch.equal(y, expect) and torch.equal(again, expect)
    w.mul_(2)  # changed in place: its rounding is made again
    with calib_arith.calib_arith(calib_arith.BFLOAT16):
        assert torch.equal(torch.nn.functional.linear(x, w, b), (x.bfloat16() @ w.bfloat16().t()).float() + b)


def test_a_weights_rounding_lives_as_long_as_the_weight(tmp_path):
    """The cache holds its sources weakly: a weight freed (a streamed block done) takes its entry with it, and a
    streamed pass under bfloat16 products keeps no float32 block alive (the pool gets them back)."""
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with calib_arith.calib_arith(calib_arith.BFLOAT16) as mode:
        torch.nn.functional.linear(x, w)
        assert len(mode._cache) == 1 and mode._held == 32 * 64 * 2
        del w
        assert len(mode._cache) == 0 and mode._held == 0
    save_tiny("llama", tmp_path)
    from halfsafe.engine.streamed import streamed_of
    from halfsafe.io.loading import load_model

    model = load_model(tmp_path, stream=True).model
    ids = [tiny_ids(model, 12, seed=i) for i in range(3)]
    with calib_arith.calib_arith(calib_arith.BFLOAT16) as mode:
        collect(model, ids, progress=False)
        assert mode.calls > 0 and mode._held == 0, "every block's weights freed, and their roundings with them"
    assert streamed_of(model).shards.pool.reused > 0


@pytest.mark.parametrize("asked", ["auto", "bfloat16"])
def test_halfsafe_json_records_the_calibration_arithmetic(tmp_path, asked, monkeypatch):
    monkeypatch.setattr(calib_arith, "bfloat16_products_speedup", lambda: 0.25)
    folder = save_tiny("llama", tmp_path / "llama")
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out), "--calib-arith", asked, "--max-samples", "1", "--seq-len", "32"]) == 0
    record = json.loads((out / "halfsafe.json").read_text())
    recorded = record["calib_arith"]
    assert recorded["asked"] == asked and recorded["used"] == ("float32" if asked == "auto" else "bfloat16") and recorded["why"]
    assert "reference" not in record["checkpoint_reads"], "the float32 reference ran beside the calibration, in its read"


def test_an_unknown_calibration_arithmetic_is_a_one_line_error(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--calib-arith", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--calib-arith" in err[-1] and "invalid choice" in err[-1] and not (tmp_path / "out").exists()


def _bf16_linear(x, w, b=None):
    y = (x.bfloat16() @ w.detach().bfloat16().t()).float()
    return y if b is None else y + b


def test_a_weight_changed_in_place_inside_one_calibration_is_rounded_again():
    """The cache's key is the weight's place and its version counter: a weight changed in place (the same tensor,
    the same memory) between two products of one calibration multiplies with its new values, however it changed
    (a whole-tensor op, a row written through a view, a copy into it as the pool's reads write a recycled tensor),
    and two views of one storage (row slices at different offsets, as a head's chunks; a matrix and its transpose)
    are never taken for each other."""
    x = torch.randn(4, 64)
    layer = torch.nn.Linear(64, 32)
    w, b = layer.weight, layer.bias
    place = w.data_ptr()
    changes = [lambda: w.mul_(2), lambda: w[3].copy_(torch.randn(64)), lambda: w.copy_(torch.randn(32, 64)),
               lambda: w.t()[5].zero_(), lambda: w.add_(1e-3)]
    with calib_arith.calib_arith(calib_arith.BFLOAT16) as mode:
        assert torch.equal(layer(x), _bf16_linear(x, w, b))
        for change in changes:
            before = layer(x)
            with torch.no_grad():
                change()
            assert w.data_ptr() == place
            after = layer(x)
            assert torch.equal(after, _bf16_linear(x, w, b)), "a stale rounding of the weight was reused"
            assert not torch.equal(after, before)
        assert mode.calls == 2 * len(changes) + 1
        square = torch.randn(64, 64)
        top, bottom = square[:32], square[32:]  # one storage, the same shape and strides, two offsets
        assert torch.equal(torch.nn.functional.linear(x, top), _bf16_linear(x, top))
        assert torch.equal(torch.nn.functional.linear(x, bottom), _bf16_linear(x, bottom))
        assert torch.equal(x @ square, (x.bfloat16() @ square.bfloat16()).float())  # mm's right operand: `square`
        assert torch.equal(x @ square.t(), (x.bfloat16() @ square.t().bfloat16()).float())  # its transpose, same place
