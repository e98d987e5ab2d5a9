"""Every family, on tiny random models: the rescalings are exact, invertible bit for bit, and fix a
model whose residual stream was blown past float16's range."""

from __future__ import annotations

import math
import random

import pytest
import torch

from halfsafe.convert import make_fp16_safe
from halfsafe.families import REGISTRY, family_for
from halfsafe.forward import logits
from halfsafe.groups import expand
from halfsafe.metrics import mean_kl
from halfsafe.precision import cast_copy
from halfsafe.rewrite import apply_exponents_
from halfsafe.scan import scan
from tiny import TINY, make_tiny, tiny_ids

KEYS = sorted(TINY)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_every_supported_model_type_has_a_tiny_model():
    covered = {TINY[k]().model_type for k in KEYS}
    assert set(REGISTRY) <= covered, f"no tiny model for {sorted(set(REGISTRY) - covered)}"


@pytest.mark.parametrize("key", KEYS)
def test_random_power_of_two_plan_is_exact(key):
    model = make_tiny(key)
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    assert groups, "the family data matched nothing"
    rng = random.Random(0)
    exps = {g.name: rng.choice([-3, -2, -1, 1, 2, 3]) for g in groups}
    apply_exponents_(model, family, groups, exps)
    out = logits(model, ids)
    assert _rel(out, ref) < 1e-6
    # and the plan really moved weights: a wrong rescale would show up above
    assert any(p.abs().max() > 0 for p in model.parameters())


@pytest.mark.parametrize("key", KEYS)
def test_plan_then_inverse_restores_weights_bit_for_bit(key):
    model = make_tiny(key)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    eps_before = model.config.to_dict()
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    rng = random.Random(1)
    exps = {g.name: rng.choice([-4, -1, 2, 5]) for g in groups}
    apply_exponents_(model, family, groups, exps)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    apply_exponents_(model, family, groups, {k: -v for k, v in exps.items()})
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p), n
    assert model.config.to_dict() == eps_before


@pytest.mark.parametrize("key", KEYS)
def test_blown_up_model_overflows_in_fp16_then_converts(key):
    # A blow-up by 2**k leaves a tied (1+w) head gain at (1+w)/2**k - 1, near -1, where neither fp32
    # nor fp16 has bits left: no real model looks like that, so the stress model unties its head.
    model = make_tiny(key, untie=True)
    ids = tiny_ids(model, length=16)
    ref = logits(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    peak = max(layer.residual_peak for layer in scan(model, [ids], progress=False).layers)
    k = math.ceil(math.log2(4 * 65504 / peak))
    apply_exponents_(model, family, groups, {g.name: k for g in groups if g.block is None})
    # Exact algebra; only a tied Gemma head loses bits, since its norm casts (1+w)/2**k - 1 to fp32.
    assert _rel(logits(model, ids), ref) < 1e-2
    ref = logits(model, ids)
    assert not scan(model, [ids], progress=False).fp16_safe
    assert not torch.isfinite(logits(cast_copy(model, torch.float16), ids)).all(), "stress model should break fp16"

    report = make_fp16_safe(model, samples=[ids], progress=False)
    assert not report.unfixable
    half = cast_copy(model, torch.float16)
    out = logits(half, ids).float()
    assert torch.isfinite(out).all()
    assert mean_kl(ref, out) < 1e-4
    assert report.fp32_output_change < 1e-5
