"""One description of which norm eps moves (families.spec.EpsScope, made by groups.eps_scopes) and one code path
(rewrite.scale_eps_): the records each family's data turns into, and what the single path does that the four
mechanisms it replaced did not (one move per norm, a missing eps field named)."""

from __future__ import annotations

import copy

import pytest
import transformers
from tiny import TINY

from halfsafe.core.groups import eps_scopes, expand
from halfsafe.core.rewrite import scale_eps_
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.families.spec import EpsScope
from halfsafe.io.loading import model_class_for


def _build(key: str, cls=None):
    config = TINY[key]()
    return (cls or model_class_for(config))(config).eval()


def test_the_family_eps_everywhere_but_a_tower():
    model = _build("qwen2_vl")
    assert eps_scopes(family_for("qwen2_vl"), model) == (
        EpsScope(("", "text_config"), ("rms_norm_eps",), keep=("model.visual",), copies_only=False),)
    bare = _build("qwen2_vl", transformers.Qwen2VLModel)  # modules named without the head's prefix
    assert eps_scopes(family_for("qwen2_vl"), bare)[0].keep == ("visual",)


def test_the_family_eps_with_norms_the_code_fixes_and_on_a_plain_model():
    model = _build("deepseek_v3")
    assert eps_scopes(family_for("deepseek_v3"), model) == (
        EpsScope(("",), ("rms_norm_eps",), fixed=("q_a_layernorm", "kv_a_layernorm"), copies_only=False),)
    t5gemma2 = _build("t5gemma2")
    (scope,) = eps_scopes(family_for("t5gemma2"), t5gemma2)
    assert scope.configs == ("", "decoder") and not scope.copies_only  # the text config is the decoder's


def test_the_family_eps_in_the_sub_configs_it_names():
    model = _build("gemma4")
    scopes = eps_scopes(family_for("gemma4"), model)
    assert scopes == (EpsScope(("text_config",), ("rms_norm_eps",), ("model.language_model",)),
                      EpsScope(("vision_config",), ("rms_norm_eps",), ("model.vision_tower", "model.embed_vision")))
    bare = _build("gemma4", transformers.Gemma4Model)
    assert eps_scopes(family_for("gemma4"), bare)[0].modules == ("language_model",)


def test_a_groups_own_eps():
    model = _build("gemma3")
    family = family_for("gemma3")
    groups = {g.name: g for g in expand(family, model)}
    assert eps_scopes(family, model, groups["vision_residual"].eps_scope) == (EpsScope(
        ("vision_config",), ("layer_norm_eps",), ("model.vision_tower", "model.multi_modal_projector.mm_soft_emb_norm")),)
    assert eps_scopes(family, model, groups["residual"].eps_scope) == (
        EpsScope(("text_config",), ("rms_norm_eps",), ("model.language_model",)),)


def test_a_group_eps_field_the_config_lacks_fails_in_one_line():
    model = _build("gemma3")
    with pytest.raises(UnsupportedModelError, match="no vision_config.rms_norm_eps") as e:
        scale_eps_(model, family_for("gemma3"), 1, ("vision_config.rms_norm_eps", ("model.vision_tower",)))
    assert "\n" not in str(e.value)


def test_each_norm_moves_once_where_two_configs_hold_eps_one_power_apart():
    """The model's config holds 1e-6, the copy its base model keeps 2e-6 (block 0's norms copied that one): with
    factor 2, every norm moves once (1e-6 -> 2e-6, 2e-6 -> 4e-6), not twice (1e-6 -> 2e-6 -> 4e-6)."""
    model = _build("llama")
    old = model.config.rms_norm_eps
    model.model.config = copy.deepcopy(model.config)
    model.model.config.rms_norm_eps = 2 * old
    for norm in (model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm):
        norm.variance_epsilon = 2 * old
    scale_eps_(model, family_for("llama"), 1)
    assert model.config.rms_norm_eps == 2 * old and model.model.config.rms_norm_eps == 4 * old
    got = {n: m.variance_epsilon for n, m in model.named_modules() if hasattr(m, "variance_epsilon")}
    assert got == {n: (4 if n.startswith("model.layers.0.") else 2) * old for n in got}
