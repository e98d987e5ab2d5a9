"""Gemma 3 multimodal, EmbeddingGemma and Gemma 3n: what the shared family tests do not see.

Image inputs: every forward pass of a gemma3 model here carries the synthetic gradient image
(forward.image_prompt), so the language model reads the projector's image-token embeddings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import make_tiny, random_exponents, save_tiny, tiny_ids
from transformers import Gemma3nConfig

from halfsafe.convert import convert_checkpoint
from halfsafe.core.forward import image_prompt, logits, model_inputs
from halfsafe.core.groups import expand
from halfsafe.core.probe import probe
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.engine.precision import cast_copy
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.runtime.baselines import clamp_residual_adds, keep_residual_fp32
from halfsafe.runtime.fp16 import load_pure_fp16
from halfsafe.scan import scan
from halfsafe.verify import verify


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


@pytest.mark.parametrize("untie", [False, True])
def test_forward_with_an_image_is_exact_under_a_random_plan(untie):
    model = make_tiny("gemma3", untie=untie)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) != untie
    ids = tiny_ids(model)
    inputs = model_inputs(model, ids)
    assert inputs["pixel_values"].shape == (1, 3, 56, 56) and int(inputs["token_type_ids"].sum()) == 4
    ref = model(**inputs).logits.detach()
    # the image reaches the text: another image changes the logits of the text after it
    other = dict(inputs, pixel_values=inputs["pixel_values"].flip(-1))
    assert _rel(model(**other).logits, ref) > 1e-3
    family = family_for("gemma3")
    groups = expand(family, model)
    assert {g.spec for g in groups} == {"residual", "vo", "up_down", "vision_residual", "vision_vo", "vision_qk"}
    apply_exponents_(model, family, groups, random_exponents(groups, 0))
    assert _rel(model(**inputs).logits, ref) < 1e-6  # measured 0 (tied and untied)


def test_each_eps_moves_with_its_own_group_only():
    """Text and tower eps are both 1e-6 here: moving one must leave the other's norms alone."""
    model = make_tiny("gemma3")
    family = family_for("gemma3")
    groups = expand(family, model)
    apply_exponents_(model, family, groups, {"residual": -2, "vision_residual": 3})
    assert model.config.text_config.rms_norm_eps == 1e-6 * 2.0 ** -4
    assert model.config.vision_config.layer_norm_eps == 1e-6 * 2.0 ** 6
    lm, tower = model.model.language_model, model.model.vision_tower
    assert {m.eps for m in lm.modules() if hasattr(m, "eps")} == {1e-6 * 2.0 ** -4}
    assert {m.eps for m in tower.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-6 * 2.0 ** 6}
    assert model.model.multi_modal_projector.mm_soft_emb_norm.eps == 1e-6 * 2.0 ** 6  # built from the tower's field


@pytest.mark.parametrize("drop", ["model.multi_modal_projector.mm_input_projection_weight", "model.vision_tower.post_layernorm.weight"])
def test_probe_rejects_a_table_that_leaves_out_an_image_write(drop):
    """Without the projector weight the image tokens keep their size while the text moves; without the tower's
    post_layernorm the projector's norm reads an input whose eps moved: both change the output."""
    model = make_tiny("gemma3")
    family = family_for("gemma3")
    spec = "residual" if "projector" in drop else "vision_residual"
    groups = tuple(replace(g, moves=tuple(m for m in g.moves if m.param != drop)) if g.name == spec else g for g in family.groups)
    wrong = replace(family, groups=groups)
    with pytest.raises(UnsupportedModelError, match=f"group {spec}: scaling it changed"):
        probe(model, wrong, expand(wrong, model), tiny_ids(model, length=8))


def test_scan_reports_the_vision_tower():
    model = make_tiny("gemma3")
    report = scan(model, [tiny_ids(model)], progress=False)
    layers = [l.name for l in report.layers]
    assert layers == ["model.vision_tower.encoder.layers.0", "model.vision_tower.encoder.layers.1",
                      "model.language_model.layers.0", "model.language_model.layers.1"]
    for site in ("model.vision_tower.embeddings.patch_embedding:out", "model.vision_tower.post_layernorm:out",
                 "model.multi_modal_projector:out", "model.vision_tower.encoder.layers.1.mlp.fc1:out"):
        assert report.sites[site].numel > 0, site
    # 16 patches of 32 channels; the projector writes 4 image tokens of the text width 64
    assert report.sites["model.vision_tower.encoder.layers.0:out"].numel == 16 * 32
    assert report.sites["model.multi_modal_projector:out"].numel == 4 * 64


def test_headless_gemma3_model_is_exact():
    from transformers import Gemma3Model

    tied = make_tiny("gemma3")
    model = Gemma3Model(tied.config).eval()
    model.load_state_dict(tied.model.state_dict())
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for("gemma3")
    groups = expand(family, model)
    assert any(m.param == "multi_modal_projector.mm_input_projection_weight" for g in groups for m in g.moves)
    apply_exponents_(model, family, groups, {g.name: -2 for g in groups})
    assert model.config.text_config.rms_norm_eps == 1e-6 * 2.0 ** -4
    assert _rel(logits(model, ids), ref) < 1e-6


@pytest.mark.parametrize("key", ["gemma3", "gemma3_text-embedding"])
def test_checkpoint_folder_converts_and_verifies(key, tmp_path):
    """scan/convert/verify from a folder, as the CLI runs them; the converted folder loads with plain transformers
    and runs an image (gemma3) or gives the last hidden state (EmbeddingGemma) in fp16 as in fp32."""
    src = save_tiny(key, tmp_path / "src")
    out = tmp_path / "out"
    report = convert_checkpoint(str(src), str(out), seq_len=32, max_samples=1, progress=False)
    assert report.fp32_output_change < 1e-6
    original = make_tiny(key)
    converted = load_pure_fp16(type(original), out)
    ids = tiny_ids(original)
    ref, got = logits(original, ids), logits(converted, ids).float()
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert _rel(got, ref) < 1e-2  # fp16 rounding only
    v = verify(original, out, texts=["a short held-out text, with numbers 1 2 3 " * 2], seq_len=32, max_samples=1,
               greedy_tokens=0, variants=["halfsafe fp16"])
    assert v.result("halfsafe fp16").overall.nonfinite_logits == 0


def test_gemma3n_is_refused_with_the_structure_that_prevents_it():
    config = Gemma3nConfig()
    assert config.model_type == "gemma3n"
    with pytest.raises(UnsupportedModelError, match=r"embedding_post_projection_norm, with_scale=False"):
        family_for(config.model_type)


def test_runtime_baselines_run_the_tower():
    """The clamp and fp32-residual baselines know the SigLIP blocks' writers; the fp32 residual stays inside the
    tower (the projector multiplies by a bare fp16 parameter)."""
    model = make_tiny("gemma3")
    ids = tiny_ids(model, length=8)
    ref = logits(model, ids)
    half = cast_copy(model, torch.float16)
    with clamp_residual_adds(half) as handle:
        logits(half, ids)
    assert handle.adds == 2 * 4  # two residual adds in each of 2 tower and 2 language blocks
    with keep_residual_fp32(half):
        out = logits(half, ids).float()
    assert _rel(out, ref) < 1e-2  # fp16 weights and matmuls; measured 1.4e-3


def test_image_prompt_only_for_image_text_models():
    assert image_prompt(make_tiny("gemma3_text")) is None
    ids, types, pixels = image_prompt(make_tiny("gemma3"))
    assert ids == [254, 256, 256, 256, 256, 255] and types == [0, 1, 1, 1, 1, 0]
    assert pixels.min() == -1 and pixels.max() == 1
