"""LongT5 and T5Gemma beyond the shared tests: the variants those do not run (LongT5's local encoder, a ReLU
feed-forward; T5Gemma with an untied head), both stacks' eps moving together, and a wrong table (the transient-
global side norm left out of the residual) rejected by the probe."""

from __future__ import annotations

import dataclasses

import pytest
from tiny import TINY, make_tiny, random_exponents, tiny_ids
from tiny.longt5 import COMMON as LONGT5
from tiny.t5gemma import config as t5gemma_config
from transformers import LongT5Config

from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.probe import probe
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for

VARIANTS = {
    "longt5-local": lambda: LongT5Config(**LONGT5, encoder_attention_type="local"),
    "longt5-tglobal-relu": lambda: LongT5Config(**{**LONGT5, "feed_forward_proj": "relu"},
                                                encoder_attention_type="transient-global"),
    "t5gemma-untied": lambda: t5gemma_config(tied=False),
}


@pytest.fixture
def variant(request, monkeypatch):
    monkeypatch.setitem(TINY, request.param, VARIANTS[request.param])
    return request.param


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant", sorted(VARIANTS), indirect=True)
def test_random_plan_is_exact_on_the_other_variants(variant):
    model = make_tiny(variant)
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    exps = random_exponents(groups, 0)
    exps["residual"] = -3
    apply_exponents_(model, family, groups, exps)
    assert _rel(logits(model, ids), ref) < 1e-6  # measured 0.0 (bit-identical) on all three


def test_t5gemma_moves_both_stacks_eps():
    model = make_tiny("t5gemma")
    family = family_for("t5gemma")
    groups = expand(family, model)
    apply_exponents_(model, family, groups, {"residual": -2})
    assert model.config.encoder.rms_norm_eps == model.config.decoder.rms_norm_eps == 1e-6 / 16
    assert all(m.eps == 1e-6 / 16 for n, m in model.named_modules() if n.endswith("norm") or n.endswith("layernorm"))


def test_probe_rejects_tglobal_without_the_side_norm():
    """Leaving `global_input_layer_norm` out of the residual group lets its shared eps move while its input
    (sums of the normed stream) does not: the probe sees the output change and names the group."""
    model = make_tiny("longt5-tglobal")
    family = family_for("longt5")
    residual = next(g for g in family.groups if g.name == "residual")
    wrong = dataclasses.replace(residual, moves=tuple(m for m in residual.moves if "global_input_layer_norm" not in m.param))
    wrong_family = dataclasses.replace(family, groups=(wrong, *family.groups[1:]))
    ids = tiny_ids(model)

    def residual_only(f):
        return [g for g in expand(f, model) if g.name == "residual"]

    probe(model, family, residual_only(family), ids)  # the real table holds
    with pytest.raises(UnsupportedModelError, match="group residual"):
        probe(model, wrong_family, residual_only(wrong_family), ids)
