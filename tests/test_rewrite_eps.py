"""Which norm eps a plan moves in the multimodal families, field by field and module by module: a group's own eps
(Gemma 3's tower, GroupSpec.eps), a family's eps in the sub-configs it names (Gemma 4, EpsScope.configs), and a
family's eps everywhere but a tower (Qwen2-VL, T5Gemma 2, EpsScope.keep), with and without the head. Every eps in these tiny
models is 1e-6, so a move that leaks into a tower (or skips a norm) shows. Only eps values are read: the models are
built from their configs, never run."""

from __future__ import annotations

import copy

import transformers
from tiny import TINY
from transformers import PretrainedConfig

from halfsafe.core.groups import Group, TensorMove, expand, resolve_eps
from halfsafe.core.rewrite import move_eps_, scale_eps_, scoped_eps_exponents, tensor_exponents
from halfsafe.families import MUL, Family, family_for
from halfsafe.families.spec import EpsScope
from halfsafe.io.loading import model_class_for

EPS = 1e-6
NORM_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_epsilon")


def _build(key: str, cls=None):
    config = TINY[key]()
    return (cls or model_class_for(config))(config).eval()


def _eps(model) -> dict[str, float]:
    """'<module>' -> value, for every module holding a float eps (under whichever name its transformers release
    gives it: Gemma 4's norms hold `eps` before 5.25, `variance_epsilon` from it)."""
    found = {(n, a): getattr(m, a) for n, m in model.named_modules() for a in NORM_EPS_ATTRS
             if isinstance(getattr(m, a, None), float)}
    assert len({n for n, _ in found}) == len(found), "a module holds two eps"
    return {n: v for (n, _), v in found.items()}


def _scale_family_eps(model, family, exponent: int) -> None:
    scale_eps_(model, family, resolve_eps(family, model), exponent)


def _moved(model, act) -> dict[str, float]:
    before = _eps(model)
    assert set(before.values()) == {EPS}
    act()
    after = _eps(model)
    assert after.keys() == before.keys()
    return {k: v for k, v in after.items() if v != before[k]}


# --- a group's own eps (GroupSpec.eps): Gemma 3's SigLIP tower and its language model ---

GEMMA3_TOWER = {f"model.vision_tower.encoder.layers.{i}.layer_norm{j}" for i in (0, 1) for j in (1, 2)} | {
    "model.vision_tower.post_layernorm", "model.multi_modal_projector.mm_soft_emb_norm"}
GEMMA3_TEXT = {f"model.language_model.layers.{i}.{n}" for i in (0, 1) for n in (
    "self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm")} | {"model.language_model.norm"}


def test_gemma3_vision_group_moves_the_towers_eps_and_the_projector_norm_only():
    model = _build("gemma3")
    family = family_for("gemma3")
    groups = expand(family, model)
    moved = _moved(model, lambda: move_eps_(model, family, groups, {"vision_residual": -1}))  # eps_power 2: / 4
    assert moved == {k: EPS / 4 for k in GEMMA3_TOWER}
    assert model.config.vision_config.layer_norm_eps == EPS / 4
    assert model.config.text_config.rms_norm_eps == EPS


def test_gemma3_residual_moves_the_language_models_eps_only():
    model = _build("gemma3")
    family = family_for("gemma3")
    groups = expand(family, model)
    moved = _moved(model, lambda: move_eps_(model, family, groups, {"residual": 1, "vision_residual": 0}))  # x 4
    assert moved == {k: EPS * 4 for k in GEMMA3_TEXT}
    assert model.config.text_config.rms_norm_eps == EPS * 4
    assert model.config.vision_config.layer_norm_eps == EPS


def test_a_group_eps_moves_the_copies_of_its_config_that_hold_the_same_value():
    model = _build("gemma3")
    family = family_for("gemma3")
    vision = model.config.vision_config
    tower = model.model.vision_tower
    tower.config = copy.deepcopy(vision)  # a sub-model's own copy, same value: moves with it
    tower.encoder.config = copy.deepcopy(vision)
    tower.encoder.config.layer_norm_eps = 3e-6  # a copy with another value: not this eps, stays
    tower.embeddings.config = PretrainedConfig()  # a config without that field: ignored
    holders = resolve_eps(family, model, (EpsScope(("layer_norm_eps",), ("vision_config",), ("model.vision_tower",)),))
    moved = _moved(model, lambda: scale_eps_(model, family, holders, -2))
    assert moved == {k: EPS / 4 for k in GEMMA3_TOWER if k.startswith("model.vision_tower.")}
    assert vision.layer_norm_eps == EPS / 4 and tower.config.layer_norm_eps == EPS / 4
    assert tower.encoder.config.layer_norm_eps == 3e-6
    assert tower.encoder.layers[0].mlp.config is vision  # the layers read the shared config
    assert model.config.text_config.rms_norm_eps == EPS


# --- a family's eps in the sub-configs it names (EpsScope.configs, with `when` for the tower): Gemma 4 ---

GEMMA4_TEXT = {f"model.language_model.layers.{i}.{n}" for i in (0, 1) for n in (
    "self_attn.q_norm", "self_attn.k_norm", "self_attn.v_norm", "input_layernorm", "post_attention_layernorm",
    "pre_feedforward_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")} | {
    "model.language_model.norm", "model.language_model.per_layer_projection_norm"}
GEMMA4_VISION = {f"model.vision_tower.encoder.layers.{i}.{n}" for i in (0, 1) for n in (
    "self_attn.q_norm", "self_attn.k_norm", "self_attn.v_norm", "input_layernorm", "post_attention_layernorm",
    "pre_feedforward_layernorm", "post_feedforward_layernorm")} | {
    "model.embed_vision", "model.embed_vision.embedding_pre_projection_norm"}


def test_gemma4_moves_the_text_and_vision_eps_and_leaves_the_audio_towers():
    model = _build("gemma4")
    family = family_for("gemma4")
    groups = expand(family, model)
    moved = _moved(model, lambda: move_eps_(model, family, groups, {"residual": -1}))  # eps_power 2: / 4
    assert len(GEMMA4_TEXT) == 18 and len(GEMMA4_VISION) == 16
    assert moved == {k: EPS / 4 for k in GEMMA4_TEXT | GEMMA4_VISION}
    assert model.config.text_config.rms_norm_eps == EPS / 4
    assert model.config.vision_config.rms_norm_eps == EPS / 4
    assert model.config.audio_config.rms_norm_eps == EPS
    assert sum(k.startswith(("model.audio_tower.", "model.embed_audio")) for k in _eps(model)) == 22  # all 1e-6


def test_gemma4_bare_model_names_its_modules_without_the_prefix():
    model = _build("gemma4", transformers.Gemma4Model)
    moved = _moved(model, lambda: _scale_family_eps(model, family_for("gemma4"), 1))
    assert moved == {k.removeprefix("model."): EPS * 2 for k in GEMMA4_TEXT | GEMMA4_VISION}
    assert model.config.text_config.rms_norm_eps == EPS * 2 and model.config.audio_config.rms_norm_eps == EPS


def test_a_scope_on_the_top_config_moves_its_field_and_the_named_modules_norms():
    model = _build("llama")
    old = model.config.rms_norm_eps
    family = Family("scoped", ("scoped",), (), eps=(EpsScope(("rms_norm_eps",), ("",), ("model.layers.0",)),))
    before = _eps(model)
    _scale_family_eps(model, family, 1)
    after = _eps(model)
    assert {k: v for k, v in after.items() if v != before[k]} == {
        "model.layers.0.input_layernorm": old * 2, "model.layers.0.post_attention_layernorm": old * 2}
    assert model.config.rms_norm_eps == old * 2


# --- a family's eps everywhere but a tower (EpsScope.keep): Qwen2-VL, T5Gemma 2 ---

QWEN2_VL_TEXT = {f"model.language_model.layers.{i}.{n}" for i in (0, 1)
                 for n in ("input_layernorm", "post_attention_layernorm")} | {"model.language_model.norm"}


def test_qwen2_vl_moves_the_language_models_eps_and_not_the_towers_equal_one():
    model = _build("qwen2_vl")
    moved = _moved(model, lambda: _scale_family_eps(model, family_for("qwen2_vl"), 1))
    assert moved == {k: EPS * 2 for k in QWEN2_VL_TEXT}
    assert model.config.text_config.rms_norm_eps == EPS * 2
    assert sum(k.startswith("model.visual.") for k in _eps(model)) == 5  # all still 1e-6


def test_qwen2_vl_bare_model_skips_its_tower_too():
    model = _build("qwen2_vl", transformers.Qwen2VLModel)
    moved = _moved(model, lambda: _scale_family_eps(model, family_for("qwen2_vl"), -1))
    assert moved == {k.removeprefix("model."): EPS / 2 for k in QWEN2_VL_TEXT}
    assert model.config.text_config.rms_norm_eps == EPS / 2


T5GEMMA2_LAYER = ("self_attn.q_norm", "self_attn.k_norm", "pre_self_attn_layernorm", "post_self_attn_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm")


def test_t5gemma2_moves_encoder_text_and_decoder_eps_and_neither_the_tower_nor_the_projector():
    model = _build("t5gemma2")
    moved = _moved(model, lambda: _scale_family_eps(model, family_for("t5gemma2"), 2))
    expected = {f"model.{stack}.layers.{i}.{n}" for stack in ("encoder.text_model", "decoder") for i in (0, 1)
                for n in T5GEMMA2_LAYER} | {"model.encoder.text_model.norm", "model.decoder.norm"}
    assert moved == {k: EPS * 4 for k in expected}
    assert model.config.encoder.text_config.rms_norm_eps == EPS * 4 and model.config.decoder.rms_norm_eps == EPS * 4
    assert model.config.encoder.vision_config.layer_norm_eps == EPS
    assert _eps(model)["model.encoder.multi_modal_projector.mm_soft_emb_norm"] == EPS


def test_deepseek_moves_every_norms_eps_but_the_mla_norms_it_hard_codes():
    model = _build("deepseek_v3")
    moved = _moved(model, lambda: _scale_family_eps(model, family_for("deepseek_v3"), 1))
    assert moved == {f"model.layers.{i}.{n}": EPS * 2 for i in (0, 1)
                     for n in ("input_layernorm", "post_attention_layernorm")} | {"model.norm": EPS * 2}
    assert model.config.rms_norm_eps == EPS * 2


def test_an_eps_field_a_config_lacks_is_skipped_and_the_next_one_moves():
    model = _build("llama")
    old = model.config.rms_norm_eps
    family = Family("two", ("two",), (), eps=(EpsScope(("layer_norm_eps", "rms_norm_eps")),))
    before = _eps(model)
    _scale_family_eps(model, family, -1)
    assert {k: v for k, v in _eps(model).items() if v != before[k]} == {k: old / 2 for k in before}
    assert model.config.rms_norm_eps == old / 2 and not hasattr(model.config, "layer_norm_eps")
    scoped = Family("two", ("two",), (), eps=(EpsScope(("layer_norm_eps", "rms_norm_eps"), ("",), ("model",)),))
    _scale_family_eps(model, scoped, 1)
    assert model.config.rms_norm_eps == old and _eps(model) == before


def test_tensor_exponents_multiply_by_the_power_and_keep_parts_apart():
    e0_rows01 = ((0, slice(0, 1)), (1, slice(0, 2)))  # expert 0, rows 0:2
    e0_rows23 = ((0, slice(0, 1)), (1, slice(2, 4)))  # expert 0, rows 2:4: same expert, another part
    groups = [Group("a", "a", None, (TensorMove("w", 2, MUL), TensorMove("x", 1, MUL, e0_rows01))),
              Group("b", "b", None, (TensorMove("x", -1, MUL, e0_rows23), TensorMove("x", 1, MUL, e0_rows01)))]
    got = tensor_exponents(groups, {"a": -3, "b": 1})
    assert got == {"w": [(MUL, -6, None)], "x": [(MUL, -2, e0_rows01), (MUL, -1, e0_rows23)]}
    assert all(type(e) is int for entries in got.values() for _, e, _ in entries)


def test_scoped_eps_exponents_add_up_the_groups_sharing_a_scope():
    scope = "vision_config.layer_norm_eps"
    other = "audio_config.eps"
    groups = [Group("a", "a", None, (), eps_power=2, eps_field=scope), Group("b", "b", None, (), eps_power=1, eps_field=scope),
              Group("c", "c", None, (), eps_power=1, eps_field=other), Group("d", "d", None, (), eps_power=2)]
    assert scoped_eps_exponents(groups, {"a": -1, "b": 3, "c": 2, "d": 5}) == {scope: 1, other: 2}
    assert scoped_eps_exponents(groups, {"a": -1, "b": 2}) == {}  # -2 + 2: no move
