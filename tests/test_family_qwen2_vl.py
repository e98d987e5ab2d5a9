"""Qwen2-VL / Qwen2.5-VL with image inputs: the merger's writes move with the language model's residual, the
vision tower's own groups are exact (its residual up to the norms' hard-coded eps), the tower's norms keep their
eps, scan reports the tower, and a model whose vision tower is blown past float16's range converts on image
samples. The image is synthetic and deterministic (tests/tiny/qwen2_vl.py: image_inputs)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import make_tiny, random_exponents
from tiny.qwen2_vl import image_inputs

from halfsafe.convert import make_fp16_safe
from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.metrics import mean_kl
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.engine.precision import cast_copy
from halfsafe.families import family_for
from halfsafe.scan import scan

KEYS = ["qwen2_vl", "qwen2_5_vl"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _vision_norms(model) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.startswith("model.visual") and ("norm" in n or n.endswith("ln_q"))]


def _norm_eps(m) -> float:
    return m.eps if hasattr(m, "eps") else m.variance_epsilon


def _set_norm_eps(m, value: float) -> None:
    setattr(m, "eps" if hasattr(m, "eps") else "variance_epsilon", value)


def _setup(key):
    model = make_tiny(key)
    family = family_for(model.config.model_type)
    return model, family, expand(family, model), image_inputs(model)


@pytest.mark.parametrize("key", KEYS)
def test_random_plan_with_an_image_is_exact(key):
    """Every group but the vision residual, at random exponents, on a forward with pixel_values: exact. The
    text residual's exponent is nonzero, so the image embeddings (merger.mlp.2) must move with it."""
    model, family, groups, inputs = _setup(key)
    ref = logits(model, inputs)
    assert _rel(logits(model, {k: v for k, v in inputs.items() if k != "pixel_values"} | {"pixel_values": inputs["pixel_values"] * 2}), ref) > 1e-3, \
        "the image must matter to the output"
    exps = random_exponents([g for g in groups if g.name != "vision_residual"], 0)
    assert exps["residual"] and any(g.spec.startswith("vis_") for g in groups)
    apply_exponents_(model, family, groups, exps)
    assert _rel(logits(model, inputs), ref) < 1e-6  # measured 0.0 (bit-identical) on both
    # the language model's eps moved by 2**(2 e), the tower's (the same 1e-6) did not
    assert model.config.text_config.rms_norm_eps == 1e-6 * 2.0 ** (2 * exps["residual"])
    assert all(_norm_eps(m) == 1e-6 for m in _vision_norms(model))


@pytest.mark.parametrize("key", KEYS)
def test_vision_residual_is_exact_up_to_its_fixed_eps(key):
    """The tower's residual group: with its norms' eps at 0, exact; with the hard-coded 1e-6, the output moves
    by about (1/s**2 - 1) eps / (2 var), small but measurable on this tiny tower (input variance ~0.1)."""
    model, family, groups, inputs = _setup(key)
    vision = [g for g in groups if g.name == "vision_residual"]
    norms = _vision_norms(model)
    assert len(norms) == 2 * model.config.vision_config.depth + 1
    ref = logits(model, inputs)
    apply_exponents_(model, family, vision, {"vision_residual": -3})
    shipped = _rel(logits(model, inputs), ref)
    apply_exponents_(model, family, vision, {"vision_residual": 3})
    for m in norms:
        _set_norm_eps(m, 0.0)
    ref0 = logits(model, inputs)
    apply_exponents_(model, family, vision, {"vision_residual": -3})
    assert _rel(logits(model, inputs), ref0) < 1e-6  # measured 0.0 on both
    assert 1e-7 < shipped < 2e-3  # measured 1.3e-4 (qwen2_vl), 1.2e-4 (qwen2_5_vl) at s = 1/8


def test_scan_reports_the_vision_tower():
    model, family, groups, inputs = _setup("qwen2_5_vl")
    report = scan(model, [inputs], progress=False)
    layers = {l.name: l for l in report.layers}
    tower = [n for n in layers if n.startswith("model.visual.blocks.")]
    assert len(tower) == model.config.vision_config.depth and all(layers[n].residual_peak > 0 for n in tower)
    assert report.sites["model.visual.merger:out"].abs_max > 0
    assert report.n_tokens == inputs["input_ids"].numel()
    # text alone never reaches the tower
    assert not any(n.startswith("model.visual") for n in {l.name for l in scan(model, [inputs["input_ids"]], progress=False).layers})


def test_blown_up_vision_tower_converts_on_image_samples():
    """Qwen2.5-VL only (the Qwen2-VL tower takes the same path through the planner, ~10 s more)."""
    model, family, groups, inputs = _setup("qwen2_5_vl")
    peak = max(l.residual_peak for l in scan(model, [inputs], progress=False).layers if l.name.startswith("model.visual"))
    k = math.ceil(math.log2(4 * 65504 / peak))
    apply_exponents_(model, family, groups, {"vision_residual": k})
    ref = logits(model, inputs)
    assert not torch.isfinite(logits(cast_copy(model, torch.float16), inputs)).all(), "the tower should overflow in fp16"
    report = make_fp16_safe(model, samples=[inputs], progress=False)
    # the tower's stream sat at 4 x 65504: the plan lowers it by 2 bits plus the 2 bits of headroom, at least
    assert report.plan.exponents["vision_residual"] <= -4  # measured -5
    out = logits(cast_copy(model, torch.float16), inputs).float()
    assert torch.isfinite(out).all()
    assert mean_kl(ref, out) < 1e-4
    assert report.fp32_output_change < 1e-5
