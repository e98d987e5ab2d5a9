"""GLM-4: a tied head's random plan is exact; the probe rejects the tables one might write from a Llama template (o_proj left out of the residual
although a post-branch norm reads it; the gate half of gate_up_proj taken for the up half), and the clamp /
fp32-residual baselines find the post-branch norms as the residual writers."""

from __future__ import annotations

import dataclasses

import pytest
from tiny import TINY, make_tiny, random_exponents, tiny_ids
from tiny.glm4 import config

from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.probe import probe
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.families.spec import Move
from halfsafe.runtime.baselines import residual_writers


def _with(family, name, moves):
    spec = next(g for g in family.groups if g.name == name)
    return dataclasses.replace(family, groups=tuple(dataclasses.replace(spec, moves=moves) if g is spec else g
                                                    for g in family.groups))


def _probe_one(model, family, name, ids):
    probe(model, family, [g for g in expand(family, model) if g.spec == name], ids)


@pytest.fixture(scope="module")
def model():
    return make_tiny("glm4")


def test_probe_rejects_a_residual_without_o_proj(model):
    family = family_for("glm4")
    ids = tiny_ids(model)
    _probe_one(model, family, "residual", ids)
    residual = next(g for g in family.groups if g.name == "residual")
    wrong = _with(family, "residual", tuple(m for m in residual.moves if "o_proj" not in m.param))
    with pytest.raises(UnsupportedModelError, match="group residual"):
        _probe_one(model, wrong, "residual", ids)


def test_probe_rejects_the_gate_half(model):
    family = family_for("glm4")
    ids = tiny_ids(model)
    _probe_one(model, family, "up_down", ids)
    gate = lambda config: slice(0, config.intermediate_size)  # noqa: E731
    wrong = _with(family, "up_down", (Move("model.layers.{i}.mlp.gate_up_proj.weight", select=(0, gate)),
                                      Move("model.layers.{i}.mlp.down_proj.weight", -1)))
    with pytest.raises(UnsupportedModelError, match="group up_down"):
        _probe_one(model, wrong, "up_down", ids)


def test_residual_writers_are_the_post_branch_norms(model):
    assert residual_writers(model) == [f"model.layers.{i}.{n}" for i in range(2)
                                       for n in ("post_self_attn_layernorm", "post_mlp_layernorm")]


def test_tied_head_random_plan_is_exact(monkeypatch):
    monkeypatch.setitem(TINY, "glm4-tied", lambda: config(tied=True))
    model = make_tiny("glm4-tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for("glm4")
    groups = expand(family, model)
    assert any(m.param == "model.norm.weight" for g in groups for m in g.moves)
    exps = random_exponents(groups, 0)
    apply_exponents_(model, family, groups, exps)
    assert float((logits(model, ids) - ref).abs().max() / ref.abs().max()) < 1e-6  # measured 0.0
