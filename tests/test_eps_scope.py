"""One description of which norm eps moves (families.spec.EpsScope, written in the family data and resolved for each
model by groups.resolve_eps into EpsHolders) and one code path (rewrite.scale_eps_): the records each family's data
turns into, what the single path does (one move per norm, a missing eps field named), and data written the old
way or contradicting itself refused when it is built."""

from __future__ import annotations

import copy

import pytest
import transformers
from tiny import TINY

from halfsafe.core.groups import EpsHolders, expand, resolve_eps
from halfsafe.core.rewrite import scale_eps_
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.families.spec import EpsScope, Family, GroupSpec, Move
from halfsafe.io.loading import model_class_for


def _build(key: str, cls=None):
    config = TINY[key]()
    return (cls or model_class_for(config))(config).eval()


def test_the_family_eps_everywhere_but_a_tower():
    model = _build("qwen2_vl")
    assert resolve_eps(family_for("qwen2_vl"), model) == (
        EpsHolders(("", "text_config"), ("rms_norm_eps",), keep=("model.visual",), copies_only=False),)
    bare = _build("qwen2_vl", transformers.Qwen2VLModel)  # modules named without the head's prefix
    assert resolve_eps(family_for("qwen2_vl"), bare)[0].keep == ("visual",)


def test_the_family_eps_with_norms_the_code_fixes_and_on_a_plain_model():
    model = _build("deepseek_v3")
    assert resolve_eps(family_for("deepseek_v3"), model) == (
        EpsHolders(("",), ("rms_norm_eps",), fixed=("q_a_layernorm", "kv_a_layernorm"), copies_only=False),)
    t5gemma2 = _build("t5gemma2")
    (scope,) = resolve_eps(family_for("t5gemma2"), t5gemma2)
    assert scope.configs == ("", "decoder") and not scope.copies_only  # the text config is the decoder's


def test_the_family_eps_in_the_sub_configs_it_names():
    model = _build("gemma4")
    scopes = resolve_eps(family_for("gemma4"), model)
    assert scopes == (EpsHolders(("text_config",), ("rms_norm_eps",), ("model.language_model",)),
                      EpsHolders(("vision_config",), ("rms_norm_eps",), ("model.vision_tower", "model.embed_vision")))
    bare = _build("gemma4", transformers.Gemma4Model)
    assert resolve_eps(family_for("gemma4"), bare)[0].modules == ("language_model",)
    config = TINY["gemma4"]()
    config.vision_config.use_clipped_linears = True  # the tower keeps its scale, so its eps stays
    clipped = model_class_for(config)(config)
    assert resolve_eps(family_for("gemma4"), clipped) == scopes[:1]


def test_a_groups_own_eps():
    model = _build("gemma3")
    family = family_for("gemma3")
    groups = {g.name: g for g in expand(family, model)}
    assert groups["vision_residual"].eps == (EpsHolders(
        ("vision_config",), ("layer_norm_eps",), ("model.vision_tower", "model.multi_modal_projector.mm_soft_emb_norm")),)
    assert groups["vision_residual"].eps_field == "vision_config.layer_norm_eps"
    assert groups["residual"].eps == (EpsHolders(("text_config",), ("rms_norm_eps",), ("model.language_model",)),)
    assert groups["residual"].eps_field == "text_config.rms_norm_eps"


def test_a_group_eps_field_the_config_lacks_fails_in_one_line():
    model = _build("gemma3")
    wrong = EpsScope(("rms_norm_eps",), ("vision_config",), ("model.vision_tower",))
    with pytest.raises(UnsupportedModelError, match="no vision_config.rms_norm_eps") as e:
        resolve_eps(family_for("gemma3"), model, (wrong,))
    assert "\n" not in str(e.value)
    absent = EpsScope(("rms_norm_eps",), ("audio_config",), ("model.audio_tower",))  # a config the model lacks
    with pytest.raises(UnsupportedModelError, match="no audio_config.rms_norm_eps"):
        resolve_eps(family_for("gemma3"), model, (absent,))


def test_each_norm_moves_once_where_two_configs_hold_eps_one_power_apart():
    """The model's config holds 1e-6, the copy its base model keeps 2e-6 (block 0's norms copied that one): with
    factor 2, every norm moves once (1e-6 -> 2e-6, 2e-6 -> 4e-6), not twice (1e-6 -> 2e-6 -> 4e-6)."""
    model = _build("llama")
    old = model.config.rms_norm_eps
    model.model.config = copy.deepcopy(model.config)
    model.model.config.rms_norm_eps = 2 * old
    for norm in (model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm):
        norm.variance_epsilon = 2 * old
    scale_eps_(model, family_for("llama"), resolve_eps(family_for("llama"), model), 1)
    assert model.config.rms_norm_eps == 2 * old and model.model.config.rms_norm_eps == 4 * old
    got = {n: m.variance_epsilon for n, m in model.named_modules() if hasattr(m, "variance_epsilon")}
    assert got == {n: (4 if n.startswith("model.layers.0.") else 2) * old for n in got}


def test_the_family_files_write_every_eps_as_an_eps_scope():
    """The one vocabulary: the family's eps on the Family, a group's own on its GroupSpec; where the code fixes the
    norms' eps (no config field), the value it fixes them at."""
    assert family_for("llama").eps == (EpsScope(("rms_norm_eps",)),) and family_for("llama").eps_attrs == ("rms_norm_eps",)
    assert family_for("bart").eps == (EpsScope((), fixed_value=1e-5),) and family_for("bart").eps_attrs == ()
    assert family_for("deepseek_v3").eps[0].fixed_value == 1e-6
    assert family_for("gemma3").eps == () and {g.name: g.eps.attrs for g in family_for("gemma3").groups if g.eps} == {
        "residual": ("rms_norm_eps",), "vision_residual": ("layer_norm_eps",)}


_RESIDUAL = (Move("model.embed_tokens.weight"),)
_TOWER = EpsScope(("layer_norm_eps",), ("vision_config",), ("model.vision_tower",))


@pytest.mark.parametrize("build, message", [
    (lambda: EpsScope(()), "with no config field"),  # no field and no fixed value: says nothing
    (lambda: EpsScope("rms_norm_eps"), "attrs is a tuple of names"),  # a bare string, not a tuple
    (lambda: EpsScope(("vision_config.layer_norm_eps",)), "attrs are field names"),  # the old eps_field spelling
    (lambda: EpsScope(("rms_norm_eps",), (".vision_config",)), "dotted paths"),
    (lambda: EpsScope(("rms_norm_eps",), modules=("",)), "modules holds an empty name"),
    (lambda: EpsScope((), fixed_value=1e-5, keep=("model.visual",)), "nothing else"),
    (lambda: EpsScope(("rms_norm_eps",), fixed=("q_a_layernorm",)), "fixed .* and fixed_value .* go together"),
    (lambda: EpsScope(("rms_norm_eps",), fixed_value=1e-6), "go together"),
    (lambda: EpsScope(("rms_norm_eps",), modules=("model.language_model",), keep=("model.visual",)), "outside modules"),
    (lambda: GroupSpec("residual", _RESIDUAL, eps=_TOWER), "moves by the group's eps_power, which is 0"),
    (lambda: GroupSpec("residual", _RESIDUAL, eps_power=2, eps="vision_config.layer_norm_eps"), "eps is an EpsScope"),
    (lambda: GroupSpec("residual", _RESIDUAL, eps_power=2, eps=EpsScope(("layer_norm_eps",))), "one field of one sub-config"),
    (lambda: GroupSpec("residual", _RESIDUAL, eps_power=2, eps=EpsScope(("layer_norm_eps", "rms_norm_eps"), ("vision_config",),
                                                                         ("model.vision_tower",))), "one field of one sub-config"),
    (lambda: GroupSpec("residual", _RESIDUAL, eps_power=2, eps=EpsScope(("layer_norm_eps",), ("vision_config",))), "name the modules"),
    (lambda: GroupSpec("residual", _RESIDUAL, eps_power=2, eps=EpsScope(("layer_norm_eps",), ("vision_config",), ("v",),
                                                                         when=bool)), "put `when` on the GroupSpec"),
    (lambda: Family("f", ("f",), (GroupSpec("residual", _RESIDUAL, eps_power=2),)), "names no config field"),
    (lambda: Family("f", ("f",), (GroupSpec("residual", _RESIDUAL, eps_power=2),), eps=(EpsScope((), fixed_value=1e-5),)),
     "names no config field"),
    (lambda: Family("f", ("f",), (), eps=EpsScope(("rms_norm_eps",))), "a tuple of EpsScope values"),
    (lambda: Family("f", ("f",), (), eps=(EpsScope(("rms_norm_eps",)), EpsScope(("layer_norm_eps",)))), "covers the whole model"),
    (lambda: Family("f", ("f",), (), eps=(EpsScope((), fixed_value=1e-5), EpsScope(("rms_norm_eps",)))), "stands alone"),
    (lambda: Family("f", ("f",), (GroupSpec("a", _RESIDUAL, eps_power=2, eps=_TOWER),),
                    eps=(EpsScope(("layer_norm_eps",), ("vision_config",), ("model.vision_tower",)),)), "would move twice"),
    (lambda: Family("f", ("f",), (GroupSpec("a", _RESIDUAL, eps_power=2, eps=_TOWER),
                                  GroupSpec("b", _RESIDUAL, eps_power=2, eps=EpsScope(("layer_norm_eps",), ("vision_config",),
                                                                                       ("model.vision_tower.encoder",))))),
     "with different scopes"),
])
def test_eps_data_that_contradicts_itself_is_refused_when_built(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("old", ["eps_attrs", "eps_scope", "eps_skip_modules", "fixed_eps_modules"])
def test_a_family_written_with_the_old_eps_fields_is_refused(old):
    with pytest.raises(TypeError, match=old):
        Family("f", ("f",), (), **{old: ("rms_norm_eps",)})
    with pytest.raises(TypeError, match="eps_field"):
        GroupSpec("residual", _RESIDUAL, eps_power=2, eps_field="vision_config.layer_norm_eps")
