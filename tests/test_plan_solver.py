"""The planner's inputs and its file format, on hand-made groups, tensors and dicts: which constraints each
measured site and moved weight (whole, in parts, as a (1+w) gain) gives, with peaks chosen as powers of two
so every expected log2 is exact; and what a plan file holds, reads back, and refuses."""

from __future__ import annotations

import json
import math

import pytest
import torch

from halfsafe.core.groups import Group, TensorMove
from halfsafe.core.plan import PLAN_FORMAT, Constraint, Plan, _describe_select, _overlap, constraints_from, predicted_log2, solve
from halfsafe.core.stats import SiteStats
from halfsafe.errors import HalfsafeError
from halfsafe.families import GAIN1P, MUL


def _group(name: str, *moves: TensorMove) -> Group:
    return Group(name, name, None, moves)


def test_constraints_from_sites_and_weights_whole_parted_and_gain():
    sites = {
        "a:out": SiteStats("a:out", "Linear", abs_max=8.0),
        "z:out": SiteStats("z:out", "Linear", abs_max=0.0),  # never non-zero: no constraint (log2(0) undefined)
        "c:out": SiteStats("c:out", "Linear", abs_max=0.5),
        "d:out": SiteStats("d:out", "Linear", abs_max=1.0),
    }
    # power 0 (a site the group does not move) and sites nobody measured leave no trace
    governed = {"g1": {"a:out": 1, "c:out": 0, "ghost:out": -1}, "g2": {"a:out": -1, "d:out": 2}, "g3": {}}
    rows01, rows23, row0, row1 = (0, slice(0, 2)), (0, slice(2, 4)), (0, slice(0, 1)), (0, slice(1, 2))
    sel6 = ((0, slice(0, 1)), (1, torch.tensor([0, 2])))  # expert 0, rows 0 and 2
    sel7 = ((0, slice(1, 2)),)  # expert 1, whole
    sel9 = ((0, slice(0, 1)),)  # expert 0, whole
    groups = [
        _group("g1", TensorMove("w.whole", 1, MUL), TensorMove("w.fused", 1, MUL, rows01), TensorMove("w.qk", 1, MUL, row0)),
        _group("g2", TensorMove("w.whole", 1, MUL), TensorMove("w.fused", -1, MUL, rows23), TensorMove("w.qk", -1, MUL, row1)),
        _group("g3", TensorMove("w.fused", 1, MUL), TensorMove("w.gain", 1, GAIN1P), TensorMove("w.zero", 1, MUL)),
        _group("g4", TensorMove("w.whole", 2, MUL), TensorMove("w.whole", -2, MUL)),  # cancels: not in the powers
        _group("g5", TensorMove("w.whole", 1, MUL), TensorMove("w.whole", 1, MUL)),  # adds up: power 2
        _group("g6", TensorMove("w.exp", 1, MUL, sel6)),
        _group("g7", TensorMove("w.exp", 1, MUL, sel7)),
        _group("g9", TensorMove("w.exp", 1, MUL, sel9)),
    ]
    exp = torch.full((2, 4, 2), 0.125)
    exp[0] = torch.tensor([[1.0, 2.0], [64.0, 3.0], [0.5, -0.25], [7.0, 6.0]])
    params = {
        "w.whole": torch.tensor([[1.0, -8.0], [2.0, 4.0]]),
        "w.fused": torch.tensor([[1.0, -4.0], [2.0, 3.0], [0.25, -0.125], [0.0, 0.25]]),
        "w.qk": torch.tensor([[0.5, -0.5], [-16.0, 1.0]]),
        "w.gain": torch.tensor([-3.0, 0.5]),  # (1+w) = [-2, 1.5]: peak 2, where |w| would say 3
        "w.zero": torch.zeros(3),  # all zero: no constraint
        "w.exp": exp,
    }
    assert constraints_from(sites, governed, groups, params) == [
        Constraint("a:out", 3.0, {"g1": 1, "g2": -1}),
        Constraint("c:out", -1.0, {}),
        Constraint("d:out", 0.0, {"g2": 2}),
        Constraint("weight:w.whole", 3.0, {"g1": 1, "g2": 1, "g5": 2}),
        # a tensor moved whole and in parts: the whole by its whole movers, each part by its own and the whole's
        Constraint("weight:w.fused", 2.0, {"g3": 1}),
        Constraint("weight:w.fused[dim 0 [0:2]]", 2.0, {"g1": 1, "g3": 1}),
        Constraint("weight:w.fused[dim 0 [2:4]]", -2.0, {"g2": -1, "g3": 1}),
        # moved only in parts: no whole-tensor constraint, each row its own peak
        Constraint("weight:w.qk[dim 0 [0:1]]", -1.0, {"g1": 1}),
        Constraint("weight:w.qk[dim 0 [1:2]]", 4.0, {"g2": -1}),
        Constraint("weight:w.gain", 1.0, {"g3": 1}),
        # expert parts: a part overlapping another (same expert) counts both groups; other experts' parts do not
        Constraint("weight:w.exp[dim 0 [0:1], dim 1, 2 indices]", 1.0, {"g6": 1, "g9": 1}),
        Constraint("weight:w.exp[dim 0 [1:2]]", -3.0, {"g7": 1}),
        Constraint("weight:w.exp[dim 0 [0:1]]", 6.0, {"g6": 1, "g9": 1}),
    ]


def test_an_empty_tensor_gives_no_constraint():
    groups = [_group("g", TensorMove("w.empty", 1, MUL), TensorMove("w", 1, MUL))]
    params = {"w.empty": torch.zeros(0, 2), "w": torch.tensor([0.25, -0.125])}
    assert constraints_from({}, {}, groups, params) == [Constraint("weight:w", -2.0, {"g": 1})]


@pytest.mark.parametrize(("a", "b", "expected"), [
    ((0, slice(None, 2)), (0, slice(0, 1)), True),  # an open start is 0
    ((0, slice(0, 2)), (0, slice(1, 2)), True),  # no step is step 1
    ((0, slice(0, 4, 2)), (0, slice(1, 4, 2)), False),  # even rows, odd rows
    ((0, slice(0, 4, 2)), (0, slice(2, 3)), True),
    ((0, torch.tensor([1, 3])), (0, slice(2, 4)), True),
    ((0, torch.tensor([0])), (0, slice(1, 3)), False),
    ((0, slice(0, 2)), (1, slice(0, 1)), True),  # no dim in common: they meet
    (((0, slice(0, 1)), (1, torch.tensor([0, 2]))), ((0, slice(0, 1)),), True),  # expert 0's rows, expert 0
    (((0, slice(0, 1)), (1, torch.tensor([0, 2]))), ((0, slice(1, 2)),), False),  # ..., expert 1
    (((0, slice(0, 1)), (1, torch.tensor([0, 2]))), ((0, slice(0, 1)), (1, torch.tensor([1, 3]))), False),
])
def test_parts_overlap_when_they_share_an_entry(a, b, expected):
    assert _overlap(a, b) is expected
    assert _overlap(b, a) is expected


def test_describe_select_names_every_dim():
    assert _describe_select(None) is None
    assert _describe_select((1, slice(2, 6))) == "dim 1 [2:6]"
    assert _describe_select((0, torch.tensor([0, 3, 5]))) == "dim 0, 3 indices"
    assert _describe_select(((0, slice(1, 2)), (2, torch.tensor([4, 7])))) == "dim 0 [1:2], dim 2, 2 indices"


def test_predicted_log2_counts_a_group_without_an_exponent_as_zero():
    c = Constraint("x", 3.0, {"a": 1, "b": -1})
    assert predicted_log2(c, {"a": -2}) == 1.0
    assert predicted_log2(c, {"a": -2, "b": -1}) == 2.0


def test_solve_skips_zero_powers_and_groups_it_does_not_plan():
    groups = [Group("residual", "residual", None, ()), Group("qk@b0", "qk", "b0", ())]
    cons = [Constraint("x", 17.0, {"residual": 1, "ghost": 1, "qk@b0": 0})]
    # residual: 17 + e <= log2(65504) - 2 = 13.9993 -> e = -4; "ghost" is no group here (exponent 0)
    assert solve(groups, cons, 2) == {"residual": -4, "qk@b0": 0}


MAXB = math.log2(65504)  # float16's largest finite value, in bits
A = [Group("a", "a", None, ())]


def test_solve_accepts_a_peak_that_lands_exactly_on_the_limit():
    # 2 * 65504 / 2 = 65504 fits with no headroom: -1, not -2 (floating error in log2 must not cost a bit)
    assert solve(A, [Constraint("x", MAXB + 1, {"a": 1})], 0) == {"a": -1}
    assert solve(A, [Constraint("x", MAXB + 2, {"a": 2})], 0) == {"a": -1}  # power 2: 4 * 65504 / 2**2
    assert solve(A, [Constraint("x", MAXB + 2.5, {"a": 1})], 0.5) == {"a": -3}


def test_solve_settles_halfway_where_upper_and_lower_bounds_cross():
    # q (power 1) is 5 bits over the limit: a <= -5. k (power -1) is 3 bits under it: -a <= 3, a >= -3;
    # then 2 bits under (a >= -2); then power -2, 4 bits under (a >= -2). Halfway: floor((-5 + -3) / 2) = -4, ...
    assert solve(A, [Constraint("q", MAXB + 5, {"a": 1}), Constraint("k", MAXB - 3, {"a": -1})], 0) == {"a": -4}
    assert solve(A, [Constraint("q", MAXB + 5, {"a": 1}), Constraint("k", MAXB - 2, {"a": -1})], 0) == {"a": -4}  # -3.5
    assert solve(A, [Constraint("q", MAXB + 6, {"a": 1}), Constraint("k", MAXB - 4, {"a": -2})], 0) == {"a": -4}
    # bounds that do not cross: the largest exponent under the upper one
    assert solve(A, [Constraint("q", MAXB + 5, {"a": 1}), Constraint("k", MAXB - 8, {"a": -1})], 0) == {"a": -5}


def test_solve_iterates_until_no_group_moves():
    # a is settled first against b = 0 (a <= -2); b then has to move by -3 on its own, which frees a back to 0
    groups = [Group("a", "a", None, ()), Group("b", "b", None, ())]
    cons = [Constraint("ab", MAXB + 2, {"a": 1, "b": 1}), Constraint("b", MAXB + 3, {"b": 1})]
    assert solve(groups, cons, 0) == {"a": 0, "b": -3}


def test_build_lists_every_moved_tensor_part_with_its_total_exponent_and_the_eps_moves():
    from halfsafe import __version__

    part = (0, slice(0, 2))
    groups = [
        Group("g1", "g1", None, (TensorMove("w.q", 1, MUL, part), TensorMove("w.k", -1, MUL)), eps_power=2),
        Group("g2", "g2", None, (TensorMove("w.z", 1, MUL),), eps_power=2),
        Group("g3", "g3", None, (TensorMove("w.q", 1, MUL, part), TensorMove("n.w", 1, GAIN1P)), eps_power=1,
              eps_field="vision_config.layer_norm_eps"),
    ]
    shapes = {"w.q": (4, 2), "w.k": (3,), "w.z": (5,), "n.w": (2,)}
    plan = Plan.build("fam", "mt", groups, {"g1": -2, "g2": 0, "g3": 1}, 1.5, 1024, shapes)
    # w.q rows 0:2 move by g1 (-2) and g3 (+1): -1; w.k by -(-2); n.w by +1; w.z not at all
    assert plan == Plan("fam", "mt", {"g1": -2, "g3": 1}, 1.5, [
        {"param": "w.q", "kind": MUL, "exponent": -1, "part": "dim 0 [0:2]", "shape": [4, 2]},
        {"param": "w.k", "kind": MUL, "exponent": 2, "part": None, "shape": [3]},
        {"param": "n.w", "kind": GAIN1P, "exponent": 1, "part": None, "shape": [2]},
    ], -4, {"vision_config.layer_norm_eps": 1}, 1024, PLAN_FORMAT, __version__)
    bare = Plan.build("fam", "mt", groups, {"g1": -2, "g3": 1}, 1.5)
    assert [t.get("shape") for t in bare.tensors] == [None, None, None] and bare.context_length is None


def _plan(**kw) -> Plan:
    d = dict(family="llama", model_type="llama", exponents={"residual": -3}, headroom_bits=2.0,
             tensors=[{"param": "w", "kind": "mul", "exponent": -3, "part": None}], eps_exponent=-6,
             eps_fields={"vision_config.layer_norm_eps": 2}, context_length=2048, format=PLAN_FORMAT, halfsafe_version="0.1.0")
    d.update(kw)
    return Plan(**d)


def test_inverse_negates_the_shared_eps_exponent():
    inv = _plan().inverse()
    assert inv.eps_exponent == 6 and inv.eps_fields == {"vision_config.layer_norm_eps": -2}
    assert inv.exponents == {"residual": 3} and inv.tensors[0]["exponent"] == 3


def test_from_dict_of_a_format_1_plan_fills_the_defaults():
    d = {"family": "llama", "model_type": "llama", "exponents": {"residual": -2}, "headroom_bits": 1.5, "tensors": []}
    p = Plan.from_dict(d)
    assert (p.family, p.model_type, p.exponents, p.headroom_bits) == ("llama", "llama", {"residual": -2}, 1.5)
    assert p.tensors == [] and p.eps_exponent == 0 and p.eps_fields == {}
    assert p.context_length is None and p.format == 1 and p.halfsafe_version == ""


def test_from_dict_reads_every_field():
    row = {"param": "x", "kind": "mul", "exponent": -1, "part": None, "shape": [2, 3]}
    d = {"family": "gemma3", "model_type": "gemma3", "exponents": {"a": -1}, "headroom_bits": 2, "tensors": [row],
         "eps_exponent": -4, "eps_fields": {"vision_config.layer_norm_eps": 3}, "context_length": 512, "format": 2,
         "halfsafe_version": "9.9"}
    assert Plan.from_dict(d) == Plan("gemma3", "gemma3", {"a": -1}, 2.0, [row], -4,
                                     {"vision_config.layer_norm_eps": 3}, 512, 2, "9.9")


def test_from_dict_refuses_a_newer_format_naming_the_version():
    d = {"family": "llama", "model_type": "llama", "exponents": {}, "headroom_bits": 2, "format": PLAN_FORMAT + 1}
    with pytest.raises(HalfsafeError, match=rf"^this plan is format {PLAN_FORMAT + 1}, made by halfsafe 7\.0; this halfsafe "
                                            rf"reads formats up to {PLAN_FORMAT}: upgrade halfsafe$"):
        Plan.from_dict(dict(d, halfsafe_version="7.0"))
    with pytest.raises(HalfsafeError, match=r"made by halfsafe \?; "):
        Plan.from_dict(d)


def test_from_dict_of_something_else_says_what_is_missing():
    with pytest.raises(HalfsafeError, match=r"^not a halfsafe plan \(model_type is None, not a name\): pass the plan\.json or "
                                            r"halfsafe\.json halfsafe wrote, unedited$"):
        Plan.from_dict({"family": "llama"})
    with pytest.raises(HalfsafeError, match=r"^not a halfsafe plan \(exponents\['a'\] is 'x'; halfsafe's exponents there are "
                                            r"integers from -24 to 24\)"):
        Plan.from_dict({"family": "llama", "model_type": "llama", "exponents": {"a": "x"}, "headroom_bits": 2, "tensors": []})


def test_save_writes_indented_json_with_a_final_newline(tmp_path):
    _plan().save(tmp_path / "plan.json")
    text = (tmp_path / "plan.json").read_text()
    assert text.startswith('{\n  "family": "llama",\n  "model_type": "llama",\n  "exponents": {\n    "residual": -3\n  },\n')
    assert text.endswith('\n  "halfsafe_version": "0.1.0"\n}\n')


def test_load_reads_a_converted_folder_and_a_wrapped_plan(tmp_path):
    plan = _plan()
    (tmp_path / "halfsafe.json").write_text(json.dumps({"plan": plan.to_dict(), "other": 1}))
    assert Plan.load(tmp_path) == plan
    assert Plan.load(str(tmp_path / "halfsafe.json")) == plan


def test_load_refuses_a_missing_file_or_a_non_plan(tmp_path):
    with pytest.raises(HalfsafeError, match=r"^cannot read a plan from .*nowhere\.json \(.*\): pass a plan\.json or a converted folder$"):
        Plan.load(tmp_path / "nowhere.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(HalfsafeError, match=r"^not a halfsafe plan \(the plan is a list, not an object\)"):
        Plan.load(tmp_path / "list.json")
