"""Every family, on tiny random models: the rescalings are exact, invertible bit for bit, and fix a
model whose residual stream was blown past float16's range."""

from __future__ import annotations

import pytest
import torch
from stress import make_stress, weight_peak
from tiny import TINY, make_tiny, random_exponents, tiny_ids

from halfsafe.convert import make_fp16_safe
from halfsafe.core.forward import logits
from halfsafe.core.groups import expand, select_parts
from halfsafe.core.metrics import mean_kl
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.engine.precision import cast_copy
from halfsafe.families import REGISTRY, family_for

KEYS = sorted(TINY)
EXACT_CHANGE = 1e-6  # measured 0 on every family but pegasus
FIXED_EPS_CHANGE = 3e-3  # pegasus: 5.7e-4 measured (fixed LayerNorm eps)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_every_supported_model_type_has_a_tiny_model():
    covered = {TINY[k]().model_type for k in KEYS}
    assert set(REGISTRY) <= covered, f"no tiny model for {sorted(set(REGISTRY) - covered)}"


def _fixed_norm_eps(key: str) -> float:
    """The norm eps a family's modeling code hard-codes (no config field, so no checkpoint can scale it): its eps
    scope names no field (attrs), only the value the code fixes."""
    return next((scope.fixed_value for scope in family_for(TINY[key]().model_type).eps if not scope.attrs), 0.0)


FIXED_EPS = ("its norm eps is fixed in the modeling code, so a rescale that moves a norm's input is exact only up "
             "to eps / s**2: ~1e-5 on this tiny model, above 1e-6 (test_fixed_norm_eps_is_the_only_error checks it)")


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=FIXED_EPS))
                                 if _fixed_norm_eps(k) else k for k in KEYS])
def test_random_power_of_two_plan_is_exact(key):
    model = make_tiny(key)
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    assert groups, "the family data matched nothing"
    exps = random_exponents(groups, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_exponents_(model, family, groups, exps)
    out = logits(model, ids)
    assert _rel(out, ref) < 1e-6
    _check_moved_as_declared(model, groups, exps, before)


def _check_moved_as_declared(model, groups, exps, before) -> None:
    """Every tensor the groups name moved by exactly 2**(sum of exponent x power), computed here by hand
    (a (1+w) gain: (1+w) * 2**e - 1 in float64); every other tensor is untouched."""
    total: dict[tuple, int] = {}
    kinds: dict[str, str] = {}
    for g in groups:
        for m in g.moves:
            parts = select_parts(m.select)
            key = tuple((dim, tuple(range(*index.indices(before[m.param].shape[dim]))) if isinstance(index, slice)
                         else tuple(torch.as_tensor(index).reshape(-1).tolist())) for dim, index in parts)
            total[(m.param, key)] = total.get((m.param, key), 0) + exps[g.name] * m.power
            kinds[m.param] = m.kind
    after = dict(model.named_parameters())
    expected = {n: t.clone() for n, t in before.items()}
    for (name, key), e in total.items():
        if kinds[name] == "gain1p":
            expected[name] = ((1 + before[name].double()) * 2.0 ** e - 1).float()
            continue
        idx = [slice(None)] * before[name].dim()
        for dim, index in key:  # one index list per dim: an outer product of rows, as torch.meshgrid would make
            idx[dim] = torch.tensor(index)
        grids = torch.meshgrid(*[i if isinstance(i, torch.Tensor) else torch.arange(before[name].shape[d])
                                 for d, i in enumerate(idx)], indexing="ij")
        expected[name][grids] = expected[name][grids] * 2.0 ** e  # parts moved by several groups compose exactly
    moved = {n for n, _ in total}
    assert moved, "the family data matched nothing"
    for n, p in after.items():
        assert torch.equal(p.detach(), expected[n]), f"{n} did not move as its group declares"


@pytest.mark.parametrize("key", [k for k in KEYS if _fixed_norm_eps(k)])
@pytest.mark.parametrize("eps_zero", [True, False])
def test_fixed_norm_eps_is_the_only_error(key, eps_zero):
    """The plan above, on a family whose norm eps is fixed in code: with that eps at 0 it must be exact;
    as shipped, the eps moves each norm's output by about (1/s**2 - 1) eps / (2 var) (var: the variance of
    its input per token), ~3e-4 for s = 1/8 on a unit-variance input, while a wrong move changes it by O(1)."""
    model = make_tiny(key)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.eps == _fixed_norm_eps(key) for m in norms), "the family's fixed eps is not the model's"
    if eps_zero:
        for m in norms:
            m.eps = 0.0
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    exps = random_exponents(groups, 0)
    apply_exponents_(model, family, groups, exps)
    # measured: 0 with eps at 0; 1.4e-5 (bart) and 9.6e-6 (pegasus) as shipped
    assert _rel(logits(model, ids), ref) < (1e-6 if eps_zero else 1e-4)


@pytest.mark.parametrize("key", KEYS)
def test_plan_then_inverse_restores_weights_bit_for_bit(key):
    model = make_tiny(key)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    eps_before = model.config.to_dict()
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    exps = random_exponents(groups, 1, choices=(-4, -1, 2, 5))
    apply_exponents_(model, family, groups, exps)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    apply_exponents_(model, family, groups, {k: -v for k, v in exps.items()})
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p), n
    assert model.config.to_dict() == eps_before


# Measured exceptions to "10x closer to fp32 than bf16" (ratio bf16 KL / halfsafe KL on this test's inputs):
# gemma 8.6 and t5 6.4 (the tiny models' ordinary channels are ~0.02, so a 2^-6 residual scale puts them near
# fp16's subnormal range, 6.1e-5; real checkpoints' are O(1)); gemma4_text-moe 5.2 (cause not established).
# pegasus reaches 14.3 though its fixed LayerNorm eps moves its fp32 output by 5.7e-4.
BELOW_10X = {"gemma": "ordinary channels near fp16 subnormals (measured 8.6x)",
             "t5": "ordinary channels near fp16 subnormals (measured 6.4x)",
             "gemma4_text-moe": "MoE blocks: measured 5.2x, cause not established (expert choices near ties?)"}


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=BELOW_10X[k]))
                                 if k in BELOW_10X else k for k in KEYS])
def test_activation_overflow_converts_finite_and_beats_bf16(key):
    """A model whose activations (never its weights) pass 65504, shaped like a real bf16 model (massive
    channels growing with depth; tests/stress.py, from the family data, not by the rescaling code): plain fp16
    overflows; converted, it runs finite on other text and at least 10x closer to fp32 than bf16 does."""
    model = make_tiny(key)
    calib, held = tiny_ids(model, length=16, seed=1), tiny_ids(model, length=32, seed=2)
    make_stress(model, lambda: (logits(model, calib), logits(model, held)))
    assert weight_peak(model) < 65504, "a stress weight itself overflows fp16"
    ref = logits(model, held)
    bf16 = mean_kl(ref, logits(cast_copy(model, torch.bfloat16), held).float())
    plain = logits(cast_copy(model, torch.float16), held).float()
    # plain fp16 breaks: inf/NaN, or (T5 clamps its fp16 hidden states in code) >10x worse than bf16 (t5: 41x)
    assert not torch.isfinite(plain).all() or mean_kl(ref, plain) > 10 * bf16, "stress model should break fp16"

    ref_calib = logits(model, calib)
    report = make_fp16_safe(model, samples=[calib], progress=False)
    assert not report.unfixable
    change = float((logits(model, calib) - ref_calib).abs().max() / ref_calib.abs().max())  # measured here, in fp32
    assert report.fp32_output_change == pytest.approx(change, rel=1e-6, abs=1e-12)
    out = logits(cast_copy(model, torch.float16), held).float()
    assert torch.isfinite(out).all()
    kl = mean_kl(ref, out)
    assert kl <= bf16 / 10, (kl, bf16)
    assert report.fp32_output_change < (FIXED_EPS_CHANGE if _fixed_norm_eps(key) else EXACT_CHANGE)
