"""convert.py's pure parts on hand-made inputs, with every expected value worked out here by hand: the margin
rule, the candidate list and choice, the fp16 storage error, the problem lists, the predicted peaks after a plan,
the report's halfsafe.json fields, the refusals of apply_plan_, and how convert_checkpoint / apply_checkpoint
wire their options through (the slow steps replaced by recorders)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny import make_tiny

import halfsafe.calibration
import halfsafe.convert.steps as convert_steps  # where each step looks up what it calls: what a test replaces
import halfsafe.io.checkpoint
import halfsafe.io.loading
from halfsafe import convert
from halfsafe.calibration import default_text, make_samples
from halfsafe.convert import (
    EVAL_TOKENS,
    Candidate,
    ConversionReport,
    _eval_ids,
    _layers_after,
    _problems,
    apply_checkpoint,
    apply_plan_,
    candidate_exponents,
    choose_candidate,
    convert_checkpoint,
    default_samples,
    keeps_margin,
    storage_error,
)
from halfsafe.core.groups import Group, expand
from halfsafe.core.margin import Margin
from halfsafe.core.plan import Constraint, Plan
from halfsafe.core.stats import SiteStats
from halfsafe.engine.reads import Reads
from halfsafe.engine.write import DEFAULT_MAX_SHARD_SIZE
from halfsafe.errors import HalfsafeError, UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.io.checkpoint import shard_size
from halfsafe.io.loading import input_paths
from halfsafe.io.report import Versions
from halfsafe.requests import MarginOptions, PlanOptions
from halfsafe.scan import LayerPeak, ScanReport

B = math.log2(65504.0)  # 15.99930: float16's largest value in bits


# --- the margin rule ---------------------------------------------------------------------------------------------

H = 2.0  # headroom bits: the limit is B - 2 = 13.99930
MARGIN_CONSTRAINTS = [
    Constraint("fixed", 30.0, {}),  # nothing moves it: ignored, the same for every candidate
    Constraint("res", 16.0, {"residual": 1}),  # reference residual -3: 13, kept under the limit
    Constraint("vo", 10.0, {"vo": 1, "residual": 1}),  # reference: 7
    Constraint("stuck", 20.0, {"g": 1, "h": -1}),  # reference (g = h = 0): 20, above the limit: may not grow
]
REFERENCE = {"residual": -3}


@pytest.mark.parametrize("exps, kept, left", [
    ({"residual": -3}, True, B - 13),  # the reference itself; tightest governed peak: 13 bits
    ({"residual": -2}, False, B - 14),  # "res" at 14 > 13.9993 (left is still reported)
    ({"residual": -4, "g": 1}, False, B - 12),  # "stuck" grows to 21
    ({"residual": -4, "g": -1}, True, B - 12),  # "stuck" shrinks to 19
    ({"residual": -4, "h": 1}, True, B - 12),  # negative power: 19
    ({"residual": -4, "h": -1}, False, B - 12),  # 21
    ({"residual": -2, "vo": -20}, False, B - 14),  # a failing peak is not undone by later ones that pass
])
def test_keeps_margin_by_hand(exps, kept, left):
    got = keeps_margin(MARGIN_CONSTRAINTS, exps, REFERENCE, H)
    assert got[0] is kept
    assert got[1] == pytest.approx(left, abs=1e-12)


def test_keeps_margin_at_the_limit_and_without_governed_peaks():
    # a peak exactly at the limit (B - H) is kept (1e-9 tolerance for float round-off); 0.001 bit over is not
    at_limit = [Constraint("edge", B - H, {"x": 1})]
    assert keeps_margin(at_limit, {}, {}, H) == (True, pytest.approx(H, abs=1e-12))
    assert keeps_margin(at_limit, {"x": 0}, {}, H)[0] is True
    over = [Constraint("edge", B - H + 0.001, {"x": 1})]  # the reference is over too: it may stay, not grow
    assert keeps_margin(over, {}, {}, H) == (True, math.inf)
    assert keeps_margin(over, {"x": 1}, {}, H) == (False, math.inf)
    # a governed peak the candidate takes over the limit by 0.001 bit
    assert keeps_margin([Constraint("e", B - H - 0.999, {"x": 1})], {"x": 1}, {"x": 0}, H)[0] is False
    # only unmovable peaks: nothing to keep, no bits reported
    assert keeps_margin([Constraint("fixed", 40.0, {})], {"residual": -3}, REFERENCE, H) == (True, math.inf)
    assert keeps_margin([], {}, {}, H) == (True, math.inf)
    # the tolerance itself: a peak exactly 1e-9 bit over the limit still counts as at it
    edge = [Constraint("edge", (B - H) + 1e-9, {"x": 1})]
    assert keeps_margin(edge, {}, {}, H) == (True, B - ((B - H) + 1e-9))
    # over the limit in the reference: a candidate 1e-9 bit above the reference's peak still counts as not larger
    assert keeps_margin([Constraint("over", 20.0, {"x": 1e-9})], {"x": 1}, {}, H) == (True, math.inf)


# --- candidates ---------------------------------------------------------------------------------------------------


def _groups(*names: str) -> list[Group]:
    return [Group(n, n, None, ()) for n in names]


def test_candidate_exponents_by_hand():
    # "r": 20 + residual <= 13.9993 -> residual <= -7; "v": 22 + residual + vo <= 13.9993 -> with vo = 0,
    # residual <= -9. So the solver's plan is residual -9, vo 0. Fixing residual at -7 / -8 leaves vo
    # floor(13.9993 - 22 + 7) = -2 / -1; at -10, -11 vo stays 0 (never above 0).
    constraints = [Constraint("r", 20.0, {"residual": 1}), Constraint("v", 22.0, {"residual": 1, "vo": 1})]
    groups = _groups("residual", "vo")
    assert candidate_exponents(groups, constraints, H, 3) == [
        {"residual": -7, "vo": -2}, {"residual": -8, "vo": -1}, {"residual": -9, "vo": 0}, {"residual": -10, "vo": 0},
        {"residual": -11, "vo": 0},
    ]
    assert candidate_exponents(groups, constraints, H, 3, above=1) == [
        {"residual": -8, "vo": -1}, {"residual": -9, "vo": 0}, {"residual": -10, "vo": 0}, {"residual": -11, "vo": 0},
    ]
    assert candidate_exponents(groups, constraints, H, 1, above=0) == [{"residual": -9, "vo": 0}]
    assert candidate_exponents(groups, constraints, H, 2, above=0) == [{"residual": -9, "vo": 0}, {"residual": -10, "vo": 0}]


def test_candidate_exponents_never_scale_up_and_need_a_residual_group():
    # 14.5 + residual <= 13.9993: residual -1; +2 would be +1 (skipped), +1 is 0 (kept), then -2, -3
    one = [Constraint("r", 14.5, {"residual": 1})]
    assert candidate_exponents(_groups("residual"), one, H, 3) == [{"residual": 0}, {"residual": -1}, {"residual": -2},
                                                                  {"residual": -3}]
    # at residual 0 already: nothing above it is tried, the smaller ones are
    low = [Constraint("r", 10.0, {"residual": 1})]
    assert candidate_exponents(_groups("residual"), low, H, 3) == [{"residual": 0}, {"residual": -1}, {"residual": -2}]
    # no residual group: the solver's plan alone
    assert candidate_exponents(_groups("vo"), [Constraint("v", 20.0, {"vo": 1})], H, 3) == [{"vo": -7}]


def _cand(kl, keeps=True, finite=True, headroom=1.0, r=0) -> Candidate:
    return Candidate({"residual": r}, kl, 0.5, finite, headroom, keeps)


def test_choose_candidate_by_hand():
    a = _cand(0.1, headroom=3.0, r=-1)
    unkept = _cand(0.01, keeps=False, r=-2)  # lowest KL but breaks the margin
    c = _cand(0.1, headroom=4.0, r=-3)  # ties a on KL, more headroom
    inf = _cand(math.inf, finite=False, headroom=9.0, r=-4)
    assert choose_candidate([a, unkept, c, inf]) is c
    assert choose_candidate([c, a]) is c
    assert choose_candidate([_cand(0.2, r=-5), a]) is a
    # none finite among those that keep the margin: the least KL (then most headroom) of those
    inf2 = _cand(math.inf, finite=False, headroom=10.0, r=-6)
    assert choose_candidate([inf, unkept, inf2]) is inf2
    # none keeps the margin: all of them
    unkept2 = _cand(0.02, keeps=False, r=-7)
    assert choose_candidate([unkept2, unkept]) is unkept
    assert Candidate({"residual": -3, "vo": 1}, 0.0, 1.0, True).residual_exponent == -3
    assert Candidate({"vo": 1}, 0.0, 1.0, True).residual_exponent == 0
    assert math.isnan(Candidate({}, 0.0, 1.0, True).headroom_bits) and Candidate({}, 0.0, 1.0, True).keeps_margin is True


# --- storage error ------------------------------------------------------------------------------------------------


def test_storage_error_by_hand():
    # value -> its float16 value, worked out by hand (10 mantissa bits; subnormals step 2^-24)
    pairs = [
        (1.0 + 2.0**-12, 1.0),  # under half a step (2^-11) above 1: rounds down
        (-3.0, -3.0),
        (2.0**-20, 2.0**-20),  # subnormal, exact
        (-(2.0**-20), -(2.0**-20)),  # negative subnormal: counted through |x|
        (3 * 2.0**-26, 2.0**-24),  # 0.75 of the smallest subnormal: rounds up to it
        (0.0, 0.0),  # zero: not a subnormal
        (2.0**-14, 2.0**-14),  # the smallest normal: not a subnormal
        (65504.0, 65504.0),  # the largest finite: not an overflow
        (1000.0 + 0.25, 1000.0),  # step 0.5 at 1000: a tie, to even
    ]
    x = torch.tensor([v for v, _ in pairs], dtype=torch.float32)
    err2 = sum((h - v) ** 2 for v, h in pairs)
    ref2 = sum(v * v for v, _ in pairs)
    want = math.sqrt(err2 / ref2)
    for chunk in (1, 2, 4, 1 << 22):  # the sums run over every chunk
        got = storage_error(x, chunk)
        assert got["fp16_rel_error"] == pytest.approx(want, rel=1e-12), chunk
        assert got["subnormal_or_zero"] == 3 and got["overflow"] == 0, chunk
    assert storage_error(x)["fp16_rel_error"] == pytest.approx(want, rel=1e-12)
    # a bf16 tensor is read as float32 first
    assert storage_error(torch.tensor([1.0 + 2.0**-7], dtype=torch.bfloat16)) == {
        "fp16_rel_error": 0.0, "subnormal_or_zero": 0, "overflow": 0}


def test_storage_error_overflow_zero_and_small_errors_beside_a_big_value():
    got = storage_error(torch.tensor([70000.0, -65536.0, 65504.0, 1.0, 65519.0]), 2)
    assert got["overflow"] == 2 and got["subnormal_or_zero"] == 0 and got["fp16_rel_error"] == math.inf
    assert storage_error(torch.zeros(5)) == {"fp16_rel_error": 0.0, "subnormal_or_zero": 0, "overflow": 0}
    # a tensor whose squares sum to under 1: 2^-3 (1 + 2^-12) stores as 2^-3 (its float32 square is 2^-25 off: 3e-8)
    small = storage_error(torch.tensor([2.0**-3 * (1 + 2.0**-12)]))["fp16_rel_error"]
    assert small == pytest.approx(2.0**-12 / (1 + 2.0**-12), rel=1e-7)
    # 2^-12 errors next to a 2^12 value: one float32 sum of both would drop them (2^24 + 2^-24 == 2^24); the errors'
    # squares are summed on their own
    x = torch.tensor([4096.0] + [1.0 + 2.0**-12] * 4)
    want = math.sqrt(4 * 2.0**-24 / (2.0**24 + 4 * (1 + 2.0**-12) ** 2))
    assert storage_error(x, 8)["fp16_rel_error"] == pytest.approx(want, rel=1e-9)


# --- problems and predicted peaks ---------------------------------------------------------------------------------


def test_problems_by_hand():
    constraints = [
        Constraint("e", 13.0, {}),  # 13 bits: fine
        Constraint("d", 15.0, {"r": 1}),  # 15 > 13.9993: tight
        Constraint("a", 17.0, {"r": 1}),  # over 65504
        Constraint("z", B, {}),  # exactly 65504: not over, but tight
        Constraint("b", 18.0, {}),  # over
        Constraint("f", B - H, {}),  # exactly at the margin: not tight
    ]
    unfixable, tight = _problems(constraints, {}, H)
    assert unfixable == [("b", 2.0**18), ("a", 2.0**17)]
    assert tight == [("z", pytest.approx(65504.0, rel=1e-12)), ("d", 2.0**15)]
    unfixable, tight = _problems(constraints, {"r": -1}, H)  # a moves to 2^16 (> 65504), d to 2^14
    assert unfixable == [("b", 2.0**18), ("a", 2.0**16)]
    assert tight == [("z", pytest.approx(65504.0, rel=1e-12)), ("d", 2.0**14)]
    assert _problems(constraints, {"r": -4}, 0.5) == ([("b", 2.0**18)], [("z", pytest.approx(65504.0, rel=1e-12))])
    assert _problems([], {}, H) == ([], [])


def _scan(layers: list[LayerPeak]) -> ScanReport:
    sites = {"model.layers.0:out": SiteStats("model.layers.0:out", "Block", abs_max=70000.0),
             "model.layers.0.mlp:out": SiteStats("model.layers.0.mlp:out", "MLP", abs_max=300.0)}
    return ScanReport("m", "llama", 2, 64, sites, layers)


def test_layers_after_predicts_block_outputs_and_keeps_unmeasured_ones():
    layers = [LayerPeak("model.layers.0", 70000.0, 70000.0, "x"), LayerPeak("model.layers.1", 100.0, 200.0, "y"),
              LayerPeak("model.layers.2", 50.0, 50.0, "z")]
    constraints = [
        Constraint("model.layers.0:out", 16.0, {"residual": 1}),
        Constraint("model.layers.1:in", 3.0, {"residual": 1}),  # not a block output
        Constraint("model.layers.1", 3.0, {"residual": 1}),  # nor this
        Constraint("model.layers.2:out", 5.0, {"residual": 1, "vo": 2}),
    ]
    assert _layers_after(_scan(layers), constraints, {"residual": -3, "vo": 1}) == [
        ("model.layers.0", 2.0**13), ("model.layers.1", 100.0), ("model.layers.2", 2.0**4)]
    assert _layers_after(_scan(layers), [], {"residual": -3}) == [
        ("model.layers.0", 70000.0), ("model.layers.1", 100.0), ("model.layers.2", 50.0)]


def test_eval_ids_are_the_first_sample_cut_to_eval_tokens():
    assert EVAL_TOKENS == 128
    first, second = torch.arange(300)[None], torch.arange(300, 600)[None]
    assert torch.equal(_eval_ids([first, second]), torch.arange(128)[None])
    assert torch.equal(_eval_ids([first[:, :50], second]), torch.arange(50)[None])


def test_default_samples_are_eight_of_512_tokens_of_the_embedded_text(monkeypatch):
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=200)))
    with monkeypatch.context() as m:
        m.setattr(convert, "make_samples", lambda *a: a)
        assert default_samples(model, "TOK") == ([default_text()], "TOK", 200, 512, 8)
    got = default_samples(model, None)
    want = make_samples([default_text()], None, 200, 512, 8)
    assert len(got) == 8 and all(s.shape == (1, 512) for s in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert max(int(s.max()) for s in got) < 200


# --- the report -----------------------------------------------------------------------------------------------------


def _report(margin) -> ConversionReport:
    plan = Plan("llama", "llama", {"residual": -3}, 2.0, [{"param": "w", "kind": "mul", "exponent": -3, "part": None}],
                0, {}, 4096, 2, "0.1.0")
    layers = [LayerPeak("model.layers.0", 70000.0, 70000.0, "x"), LayerPeak("model.layers.1", 100.0, 200.0, "y")]
    return ConversionReport(
        plan=plan, scan_before=_scan(layers), layers_after=[("model.layers.0", 8750.0), ("model.layers.1", 12.5)],
        unfixable=[("g:out", 1e5), ("h:out", 7e4)], tight=[("t:out", 3e4)],
        candidates=[Candidate({"residual": -2}, math.inf, 0.25, False, 1.5, False),
                    Candidate({"residual": -3, "vo": 0}, 0.01, 0.99, True, 2.5, True)],
        storage=[{"param": "w", "before": {"x": 1}, "after": {"x": 2}}], fp32_output_change=1e-7, fp16_finite=True,
        notes=["n1"], margin=margin,
    )


def test_report_fields_and_chosen_candidate():
    margin = Margin(4096, 64, 2.0, "rule")
    r = _report(margin)
    assert r.to_dict() == {
        "plan": {"family": "llama", "model_type": "llama", "exponents": {"residual": -3}, "headroom_bits": 2.0,
                 "tensors": [{"param": "w", "kind": "mul", "exponent": -3, "part": None}], "eps_exponent": 0, "eps_fields": {},
                 "context_length": 4096, "format": 2, "halfsafe_version": "0.1.0"},
        "margin": {"context_length": 4096, "calibrated_tokens": 64, "bits": 2.0, "rule": "rule"},
        "peaks_before": {"model.layers.0": 70000.0, "model.layers.1": 100.0},
        "peaks_after": {"model.layers.0": 8750.0, "model.layers.1": 12.5},
        "peak_before": 70000.0,
        "unfixable": [{"site": "g:out", "abs_max": 1e5}, {"site": "h:out", "abs_max": 7e4}],
        "below_headroom_target": [{"site": "t:out", "abs_max": 3e4}],
        "candidates": [
            {"exponents": {"residual": -2}, "kl": math.inf, "top1": 0.25, "finite": False, "headroom_bits": 1.5, "keeps_margin": False},
            {"exponents": {"residual": -3, "vo": 0}, "kl": 0.01, "top1": 0.99, "finite": True, "headroom_bits": 2.5,
             "keeps_margin": True},
        ],
        "tensor_storage": [{"param": "w", "before": {"x": 1}, "after": {"x": 2}}],
        "fp32_output_change": 1e-7,
        "fp16_finite_on_calibration": True,
        "notes": ["n1"],
    }
    assert _report(None).to_dict()["margin"] is None
    # the chosen candidate: its non-zero exponents are the plan's
    assert r.chosen is r.candidates[1]
    assert [r.is_chosen(c) for c in r.candidates] == [False, True]
    assert not r.is_chosen(Candidate({"residual": -3, "vo": 1}, 0.0, 1.0, True))
    assert ConversionReport(r.plan, r.scan_before, [], [], [], [], [], 0.0, True).notes == []


# --- apply_plan_ refusals -------------------------------------------------------------------------------------------

EXPS = {"residual": -1, "vo@model.layers.0": -2}


@pytest.fixture(scope="module")
def llama():
    model = make_tiny("llama")
    family = family_for("llama")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return model, Plan.build(family.name, "llama", expand(family, model), EXPS, 2.0, None, shapes)


def _refused(model, plan, match: str) -> None:
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(HalfsafeError, match=match):
        apply_plan_(model, plan)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing changed


def _edit(plan: Plan, **changes) -> Plan:
    d = plan.to_dict()
    d.update(changes)
    return Plan(**d)


def test_apply_plan_refuses_a_plan_that_does_not_fit(llama):
    model, plan = llama
    _refused(model, _edit(plan, model_type="gpt2"), r"^the plan is for model_type 'gpt2', this model is 'llama'$")
    ghosts = {f"zz{i}": -1 for i in range(7)}
    _refused(model, _edit(plan, exponents={**plan.exponents, **ghosts}),
             r"^the plan names groups this model does not have: zz0, zz1, zz2, zz3, zz4$")
    rows = [dict(t) for t in plan.tensors]
    _refused(model, _edit(plan, tensors=rows + [{"param": "model.nope.weight", "kind": "mul", "exponent": -1, "part": None}]),
             r"^the plan moves model.nope.weight, which this model does not have: it was made for another architecture$")
    wrong = [dict(t, shape=[7, 7]) if t["param"] == "model.embed_tokens.weight" else t for t in rows]
    _refused(model, _edit(plan, tensors=wrong),
             r"^model.embed_tokens.weight is \[256, 64\] here but \[7, 7\] in the plan: the plan was made for a model of another size$")
    edited = [dict(t, exponent=t["exponent"] + 1) if i == 0 else t for i, t in enumerate(rows)]
    _refused(model, _edit(plan, tensors=edited, halfsafe_version="9.9"),
             r"^the plan's tensor list \(halfsafe 9.9\) differs from what today's llama data moves for the same groups: "
             "convert the model again$")
    _refused(model, _edit(plan, tensors=edited, halfsafe_version=""), r"\(halfsafe 0.1.0\) differs")
    for key in ("param", "kind", "part"):  # each field of a row counts
        other = [dict(t, **{key: "x"}) if i == 1 and key != "param" else t for i, t in enumerate(rows)]
        if key == "param":
            other = rows[:-1] + [{k: v for k, v in rows[-1].items() if k != "shape"} | {"param": rows[0]["param"]}]
        _refused(model, _edit(plan, tensors=other), "differs")


def test_apply_plan_scales_exactly_the_listed_tensors(llama):
    model, plan = llama
    unshaped = _edit(plan, tensors=[{k: v for k, v in t.items() if k != "shape"} for t in plan.tensors])  # older plans
    for p in (plan, unshaped):
        m = make_tiny("llama")
        before = {n: t.detach().clone() for n, t in m.named_parameters()}
        apply_plan_(m, p)
        moved = {t["param"]: t["exponent"] for t in p.tensors}
        assert moved["model.embed_tokens.weight"] == -1 and moved["model.layers.0.self_attn.v_proj.weight"] == -2
        for n, t in m.named_parameters():
            assert torch.equal(t, before[n] * 2.0 ** moved.get(n, 0)), n
    # a plan without a tensor list (format 1) is applied from its exponents alone; from format 2 on an empty list is refused
    m = make_tiny("llama")
    e = m.model.embed_tokens.weight.detach().clone()
    apply_plan_(m, _edit(plan, tensors=[], format=1))
    assert torch.equal(m.model.embed_tokens.weight, e / 2)
    _refused(make_tiny("llama"), _edit(plan, tensors=[]), "^the plan's tensor list .* differs from what today's llama data moves")


# --- convert_checkpoint and apply_checkpoint: the wiring ---------------------------------------------------------------


class _Config:
    def __init__(self, model_type: str = "llama") -> None:
        self.model_type = model_type

    def get_text_config(self):
        return SimpleNamespace(vocab_size=300)


@pytest.fixture
def recorded(monkeypatch):
    """Every slow step of convert_checkpoint / apply_checkpoint replaced by a recorder of its arguments."""
    calls = []
    model = SimpleNamespace(config=_Config(), named_modules=lambda: iter(()))  # no learned positions: seq_len kept
    loaded = SimpleNamespace(model=model, tokenizer="TOK", folder=Path("/the/source"))
    loaded.set_tokenizer_aside = lambda: (lambda: "TOK again")  # the tokenizer is dropped, and given back to save
    report = SimpleNamespace(record=lambda source: {"source": source, "plan": "P", "peak_before": 1.0}, storage=[], reads=Reads())
    sample = torch.zeros(1, 4, dtype=torch.long)

    def record(name, result=None):
        def f(*args, **kwargs):
            if name == "save":  # its info is made once the weights are written
                args = tuple(a() if callable(a) else a for a in args)
            calls.append((name, args, kwargs))
            return result() if callable(result) else result
        return f

    monkeypatch.setattr(halfsafe.io.checkpoint, "check_out_dir", record("check"))
    monkeypatch.setattr(halfsafe.io.checkpoint, "output_bytes", lambda m: 12345 if m is loaded.model else -1)
    monkeypatch.setattr(halfsafe.io.checkpoint, "save_fp16_checkpoint", record("save"))
    monkeypatch.setattr(halfsafe.io.loading, "load_model", record("load", loaded))
    monkeypatch.setattr(convert_steps, "long_sample_ids", record("long", "LONG"))
    monkeypatch.setattr(halfsafe.calibration, "make_samples", record("samples", lambda: [sample]))  # cut in halfsafe.job
    monkeypatch.setattr(convert_steps, "rescale_with", record("make", report))
    monkeypatch.setattr(convert_steps, "apply_measured_", record("apply", list))
    monkeypatch.setattr(convert_steps, "check_plan", record("fits"))  # apply: the plan's names and shapes, right after loading
    return SimpleNamespace(calls=calls, loaded=loaded, report=report, sample=sample, record=record)


def test_convert_checkpoint_defaults_reach_each_step(recorded):
    r, m = recorded, recorded.loaded.model
    assert convert_checkpoint("src", "out") is r.report
    assert r.calls == [
        ("check", ("out", False), {"inputs": input_paths("src")}),  # what MODEL names, as far as known before loading
        ("load", ("src",), {"stream": True, "device": "auto"}),
        ("check", ("out", False, 12345), {"inputs": [*input_paths("src"), Path("/the/source")]}),
        ("samples", ([default_text()], "TOK", 300, 512, 8), {}),
        ("make", (m, [r.sample], PlanOptions(), True), {}),
        ("save", (m, "TOK again", "out", {"source": "src", "plan": "P", "peak_before": 1.0}, Path("/the/source"), False,
                  shard_size(DEFAULT_MAX_SHARD_SIZE), True), {"finish": None}),
    ]


def test_convert_checkpoint_options_reach_each_step(recorded):
    r, m = recorded, recorded.loaded.model
    convert_checkpoint(Path("src"), "out", texts=["a text"], seq_len=64, max_samples=None, headroom_bits=3.0, allow_unfixable=True,
                       overwrite=True, progress=False, long_sample=2, stream=False, device="cpu", max_shard_size="1GB")
    assert r.calls == [
        ("check", ("out", True), {"inputs": input_paths("src")}),
        ("load", (Path("src"),), {"stream": False, "device": "cpu"}),
        ("check", ("out", True, 12345), {"inputs": [*input_paths("src"), Path("/the/source")]}),
        ("samples", (["a text"], "TOK", 300, 64, None), {}),
        ("long", ("TOK", 300, 2), {}),
        ("make", (m, [r.sample, "LONG"], PlanOptions(MarginOptions(headroom_bits=3.0), allow_unfixable=True), False), {}),
        ("save", (m, "TOK again", "out", {"source": "src", "plan": "P", "peak_before": 1.0}, Path("/the/source"), True, 10**9, False), {"finish": None}),
    ]
    r.calls.clear()
    convert_checkpoint("src", "out", max_context=1000)
    assert r.calls[4][1][2].margin.max_context == 1000 and len(r.calls[4][1][1]) == 1  # no long sample


@pytest.mark.parametrize("options, match", [
    ({"long_sample": 1}, "^--long-sample 1 is too short: use at least 2 tokens$"),
    ({"long_sample": 0}, "--long-sample 0 is too short"),
    ({"max_context": 0}, "--max-context 0"),
    ({"headroom_bits": 16.0}, "--headroom-bits 16.0"),
])
def test_convert_checkpoint_bad_options_fail_before_loading(recorded, options, match):
    with pytest.raises(HalfsafeError, match=match):
        convert_checkpoint("src", "out", **options)
    assert recorded.calls == []  # the request is checked as it is made: before the output, before anything loads


def test_convert_checkpoint_unsupported_model_fails_before_the_output_checks(recorded):
    recorded.loaded.model.config = _Config("no-such-model")
    with pytest.raises(UnsupportedModelError):
        convert_checkpoint("src", "out")
    assert [c[0] for c in recorded.calls] == ["check", "load"]


def _scanned(headroom_bits: float, safe: bool):
    peak = SimpleNamespace(abs_max=1000.0, name="x:out", headroom_bits=headroom_bits)
    return SimpleNamespace(peak=peak, fp16_safe=safe, first_nonfinite_fp16=None if safe else "y:out")


@pytest.mark.parametrize("bits, safe, kept", [(2.0, True, True), (1.5, False, False), (2.5, True, True)])
def test_apply_checkpoint_defaults_reach_each_step(recorded, monkeypatch, tmp_path, bits, safe, kept):
    r, m = recorded, recorded.loaded.model
    plan = Plan("llama", "llama", {"residual": -1}, 2.0, [], 0, {}, None, 2, "0.1.0")
    plan.save(tmp_path / "plan.json")
    after = _scanned(bits, safe)
    monkeypatch.setattr(convert_steps, "scan", r.record("scan", after))
    read = ("the plan", str(tmp_path / "plan.json"))  # OUT may not hold it
    steps = [
        ("check", ("out", False), {"inputs": [*input_paths("src"), read]}),
        ("load", ("src",), {"stream": True, "device": "auto"}),
        ("check", ("out", False, 12345), {"inputs": [*input_paths("src"), Path("/the/source"), read]}),
        ("fits", (m, plan), {}),  # before the samples and anything slow
        ("samples", ([default_text()], "TOK", 300, 256, 2), {}),  # cut before the work, as for every command (halfsafe.job)
        ("apply", (m, plan), {}),
        ("scan", (m, [r.sample]), {"fp16_check": True, "progress": True, "name": "src"}),
    ]
    if not safe:  # never saved: the scan found it not fp16-safe
        with pytest.raises(HalfsafeError, match=r"^not fp16-safe after the plan: peak 1000 at x:out, first non-finite fp16 "
                                                r"module y:out; .* nothing was written"):
            apply_checkpoint(str(tmp_path / "plan.json"), "src", "out")
        assert r.calls == steps
        return
    got_plan, got_after = apply_checkpoint(str(tmp_path / "plan.json"), "src", "out")
    assert got_plan == plan and got_after is after
    info = {"source": "src", "applied_plan_from": str(tmp_path / "plan.json"), "plan": plan.to_dict(), "peak_after": 1000.0,
            "scan_after": {"fp16_safe": safe, "first_nonfinite_fp16": None if safe else "y:out", "peak_site": "x:out",
                           "headroom_bits": bits, "margin_kept": kept}, "tensor_storage": []}
    saved = r.calls[-1][1][3]  # the record, as halfsafe.json will hold it
    assert r.calls == [*steps, ("save", (m, "TOK again", "out", saved, Path("/the/source"), False, shard_size(DEFAULT_MAX_SHARD_SIZE), True), {"finish": None})]
    assert saved.to_dict() == {**Versions.current().to_dict(), **info}


def test_apply_checkpoint_options_reach_each_step(recorded, monkeypatch, tmp_path):
    r, m = recorded, recorded.loaded.model
    plan = Plan("llama", "llama", {"residual": -1}, 2.0, [], 0, {}, None, 2, "0.1.0")
    plan.save(tmp_path / "plan.json")
    monkeypatch.setattr(convert_steps, "scan", r.record("scan", _scanned(3.0, True)))
    apply_checkpoint(tmp_path / "plan.json", Path("src"), "out", texts=["t"], seq_len=32, max_samples=None, overwrite=True,
                     progress=False, stream=False, device="cpu")
    assert [c[:2] for c in r.calls[:6]] == [("check", ("out", True)), ("load", (Path("src"),)), ("check", ("out", True, 12345)),
                                            ("fits", (m, plan)), ("samples", (["t"], "TOK", 300, 32, None)), ("apply", (m, plan))]
    assert r.calls[1][2] == {"stream": False, "device": "cpu"}
    assert r.calls[6][2] == {"fp16_check": True, "progress": False, "name": "src"}
    assert r.calls[7][1][3].source == "src" and r.calls[7][1][5:] == (True, shard_size(DEFAULT_MAX_SHARD_SIZE), False)
    # a plan that cannot be read fails after the first output check, before loading
    r.calls.clear()
    with pytest.raises(HalfsafeError, match="cannot read a plan"):
        apply_checkpoint(str(tmp_path / "missing.json"), "src", "out")
    assert [c[0] for c in r.calls] == ["check"]
