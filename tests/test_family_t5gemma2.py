"""T5Gemma 2 with an image: the projector's writes (mm_input_projection_weight) and eoi_embedding move with the
residual, the SigLIP tower's pairs are exact, the tower's and projector norm's eps (equal to the text eps) stay,
and scan reports the tower. The image is synthetic and deterministic (tests/tiny/t5gemma2.py: image_inputs)."""

from __future__ import annotations

import torch
from tiny import make_tiny, random_exponents
from tiny.t5gemma2 import EOI, image_inputs

from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.families import family_for
from halfsafe.scan import scan


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _model():
    model = make_tiny("t5gemma2")
    with torch.no_grad():  # zero-initialised in transformers: give the image a path into the text
        w = model.model.encoder.multi_modal_projector.mm_input_projection_weight
        w.copy_((torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.2).bfloat16().float())
    return model


def test_random_plan_with_an_image_is_exact():
    model = _model()
    inputs = image_inputs(model)
    assert EOI in inputs["input_ids"]
    ref = logits(model, inputs)
    assert _rel(logits(model, {**inputs, "pixel_values": inputs["pixel_values"].flip(-1)}), ref) > 1e-3, \
        "the image must matter to the output"
    family = family_for("t5gemma2")
    groups = expand(family, model)
    exps = random_exponents(groups, 0)
    exps["residual"] = -3
    apply_exponents_(model, family, groups, exps)
    assert _rel(logits(model, inputs), ref) < 1e-6  # measured 0.0 (bit-identical)
    assert model.config.encoder.text_config.rms_norm_eps == model.config.decoder.rms_norm_eps == 1e-6 / 64
    kept = [m for n, m in model.named_modules() if n.startswith(("model.encoder.vision_tower", "model.encoder.multi_modal_projector"))
            and isinstance(getattr(m, "eps", None), float)]
    assert len(kept) == 2 * 2 + 1 + 1 and all(m.eps == 1e-6 for m in kept)  # layer_norm1/2 x 2 layers, post, mm norm


def test_scan_reports_the_vision_tower():
    model = _model()
    report = scan(model, [image_inputs(model)], progress=False)
    tower = [l for l in report.layers if l.name.startswith("model.encoder.vision_tower.encoder.layers.")]
    assert len(tower) == 2 and all(l.residual_peak > 0 for l in tower)
    assert report.sites["model.encoder.multi_modal_projector:out"].abs_max > 0
