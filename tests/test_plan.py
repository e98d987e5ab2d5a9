"""The planner is a pure function of measured peaks: check its choices on hand-made constraints."""

from __future__ import annotations

import json

import torch
from tiny import make_tiny, tiny_ids

from halfsafe.convert import apply_plan_
from halfsafe.core.forward import logits
from halfsafe.core.groups import Group, expand
from halfsafe.core.plan import Constraint, Plan, predicted_log2, solve
from halfsafe.families import family_for

G = [Group("residual", "residual", None, ()), Group("qk@b0", "qk", "b0", ())]


def test_largest_exponent_that_leaves_the_headroom():
    cons = [Constraint("layer:out", 17.0, {"residual": 1})]
    exps = solve(G, cons, headroom_bits=2)
    assert exps["residual"] == -4  # 2**17 / 16 = 8192 <= 65504 / 4 < 2**17 / 8
    assert exps["qk@b0"] == 0  # nothing asks it to move
    assert solve(G, [Constraint("x", 10.0, {"residual": 1})], 2)["residual"] == 0  # never scales up


def test_negative_powers_bound_from_below():
    # q overflows, k is near the limit: q x c shrinks q but k / c grows k; the solver balances them
    cons = [Constraint("q:out", 17.0, {"qk@b0": 1}), Constraint("k:out", 12.0, {"qk@b0": -1})]
    e = solve(G, cons, headroom_bits=2)["qk@b0"]
    assert all(predicted_log2(c, {"qk@b0": e}) < 15.9993 for c in cons)
    assert e < 0


def test_plan_round_trips_through_json_and_inverts(tmp_path):
    model = make_tiny("llama")
    ids = tiny_ids(model)
    ref = logits(model, ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = expand(family_for("llama"), model)
    plan = Plan.build("llama", "llama", groups, {"residual": -3, groups[1].name: 2}, 2.0)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.tensors and loaded.eps_exponent == -6
    apply_plan_(model, loaded)
    assert torch.allclose(logits(model, ids), ref, rtol=0, atol=1e-6 * ref.abs().max())
    apply_plan_(model, loaded.inverse())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_inverse_negates_every_exponent_and_keeps_the_rest():
    model = make_tiny("gemma3")
    groups = expand(family_for("gemma3"), model)
    exps = {g.name: (-3 if i % 2 else 2) for i, g in enumerate(groups)}
    plan = Plan.build("gemma3", "gemma3", groups, exps, 1.25, 4096, {n: tuple(p.shape) for n, p in model.named_parameters()})
    inv = plan.inverse()
    assert inv.exponents == {k: -v for k, v in plan.exponents.items()} and inv.eps_exponent == -plan.eps_exponent
    assert plan.eps_fields and inv.eps_fields == {k: -v for k, v in plan.eps_fields.items()}
    assert [t["exponent"] for t in inv.tensors] == [-t["exponent"] for t in plan.tensors]
    assert [{k: v for k, v in t.items() if k != "exponent"} for t in inv.tensors] == \
        [{k: v for k, v in t.items() if k != "exponent"} for t in plan.tensors]
    assert (inv.family, inv.model_type, inv.headroom_bits, inv.context_length, inv.format, inv.halfsafe_version) == \
        (plan.family, plan.model_type, 1.25, 4096, plan.format, plan.halfsafe_version)
    assert inv.inverse() == plan and Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
