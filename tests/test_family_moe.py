"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V2/V3): what the three
tests of test_families.py do not see. Routing reads the normed stream, so no exact rescale may change which
experts a token goes to; each expert's up/down pair moves that expert's slice of the fused tensors, no more;
a table that leaves an expert's write out is refused; the fp32-residual and clamp baselines run on MoE blocks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny import TINY, make_tiny, random_exponents, tiny_ids

from halfsafe.convert import make_fp16_safe
from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.plan import constraints_from, solve
from halfsafe.core.probe import _passes, probe
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.engine.precision import cast_copy
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import GroupSpec, Move, family_for
from halfsafe.families.spec import tied_head
from halfsafe.io.loading import model_class_for
from halfsafe.runtime.baselines import clamp_residual_adds, keep_residual_fp32
from halfsafe.scan import scan

MOE_KEYS = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def chosen_experts(model, ids) -> dict[str, torch.Tensor]:
    """router module -> the top-k expert indices of every token (sorted per token), in execution order.
    Every router of these families returns (logits, weights, indices)."""
    found: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, args, out, name=name: found.__setitem__(name, out[2].sort(-1).values))
               for name, m in model.named_modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
    try:
        logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert found, "no router ran"
    return found


def _same_routing(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_tiny_moe_models_have_dense_and_moe_layers():
    kinds = {TINY[k]().model_type for k in TINY}
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"} <= kinds
    for key in ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):  # first layer dense, second MoE
        names = [n for n, _ in make_tiny(key).named_parameters()]
        assert "model.layers.0.mlp.up_proj.weight" in names and "model.layers.1.mlp.experts.gate_up_proj" in names, key


@pytest.mark.parametrize("key", MOE_KEYS)
def test_random_plan_keeps_the_chosen_experts(key):
    model = make_tiny(key)
    ids = tiny_ids(model)
    before = chosen_experts(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    exps = random_exponents(groups, 0)
    apply_exponents_(model, family, groups, exps)
    assert _same_routing(chosen_experts(model, ids), before)
    # A rescale the router does see changes the routing on these models, so the check above can fail:
    # scaling the normed stream's gain by 2**3 sharpens the router's softmax and shifts V3's sigmoid scores.
    for name, p in model.named_parameters():
        if name.endswith("post_attention_layernorm.weight"):
            p.data.mul_(-1.0)
    assert not _same_routing(chosen_experts(model, ids), before)


@pytest.mark.parametrize("key", ["deepseek_v3"])  # sigmoid scores plus a bias: the routing most sensitive to a change
def test_conversion_of_a_blown_up_model_keeps_the_chosen_experts(key):
    """Blow the residual up past fp16's range, convert: the routers choose the same experts in fp32 throughout,
    and the converted model in fp16 chooses what the fp32 model chooses for all but near-ties."""
    model = make_tiny(key, untie=True)
    ids = tiny_ids(model, length=16)
    original = chosen_experts(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    peak = max(layer.residual_peak for layer in scan(model, [ids], progress=False).layers)
    apply_exponents_(model, family, groups, {"residual": math.ceil(math.log2(4 * 65504 / peak))})
    assert _same_routing(chosen_experts(model, ids), original)
    report = make_fp16_safe(model, samples=[ids], progress=False)
    assert report.plan.exponents.get("residual", 0) < 0
    assert _same_routing(chosen_experts(model, ids), original)
    half = chosen_experts(cast_copy(model, torch.float16), ids)
    agree = sum(int((half[k] == original[k]).all(-1).sum()) for k in original) / sum(len(v) for v in original.values())
    assert agree >= 0.9  # measured: 1.0 (also on the other five MoE keys)


def test_one_expert_pair_moves_only_that_experts_slices():
    model = make_tiny("mixtral")
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for("mixtral")
    groups = expand(family, model)
    names = sorted(g.name for g in groups if g.spec == "expert_up_down")
    assert names == [f"expert_up_down@model.layers.{i}#{e}" for i in range(2) for e in range(4)]
    # the probe scales every expert of every block in one pass: each expert's activations are its own sites
    assert len(_passes([g for g in groups if g.spec == "expert_up_down"])) == 1
    params = dict(model.named_parameters())
    gu, down = params["model.layers.1.mlp.experts.gate_up_proj"], params["model.layers.1.mlp.experts.down_proj"]
    gu0, down0 = gu.detach().clone(), down.detach().clone()
    apply_exponents_(model, family, groups, {"expert_up_down@model.layers.1#2": 3})
    inter = model.config.intermediate_size
    expect_gu, expect_down = gu0.clone(), down0.clone()
    expect_gu[2, inter:] *= 8
    expect_down[2] /= 8
    assert torch.equal(gu, expect_gu) and torch.equal(down, expect_down)
    assert _rel(logits(model, ids), ref) < 1e-6


@pytest.mark.parametrize("key", MOE_KEYS)
def test_tied_heads_random_plan_is_exact(key):
    """The tied-head move (final norm / a); the tiny keys are untied, as every released checkpoint is."""
    torch.manual_seed(0)
    config = TINY[key]()
    config.tie_word_embeddings = True
    model = model_class_for(config)(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    assert tied_head(model)
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    assert any(m.param == "model.norm.weight" for g in groups for m in g.moves)
    apply_exponents_(model, family, groups, random_exponents(groups, 0))
    assert _rel(logits(model, ids), ref) < 1e-6


def _replace_group(family, name: str, **changes):
    return dataclasses.replace(family, groups=tuple(dataclasses.replace(g, **changes) if g.name == name else g
                                                    for g in family.groups))


def test_a_table_that_misses_the_experts_writes_is_refused():
    model = make_tiny("qwen2_moe")
    ids = tiny_ids(model, length=8)
    family = family_for("qwen2_moe")
    residual = next(g for g in family.groups if g.name == "residual")
    for left_out in ("model.layers.{i}.mlp.experts.down_proj", "model.layers.{i}.mlp.shared_expert.down_proj.weight"):
        wrong = _replace_group(family, "residual", moves=tuple(m for m in residual.moves if m.param != left_out))
        with pytest.raises(UnsupportedModelError, match="changed this Qwen2MoeForCausalLM's output"):
            probe(model, wrong, expand(wrong, model), ids)


def test_an_expert_pair_on_the_gate_rows_is_refused():
    """The gate half of gate_up_proj feeds SiLU: an 'up/down' pair that selects it is not exact."""
    model = make_tiny("mixtral")
    ids = tiny_ids(model, length=8)
    family = family_for("mixtral")
    pair = next(g for g in family.groups if g.name == "expert_up_down")
    gate_rows = (1, lambda config: slice(0, config.intermediate_size))
    wrong = _replace_group(family, "expert_up_down", moves=(dataclasses.replace(pair.moves[0], select=gate_rows), pair.moves[1]))
    with pytest.raises(UnsupportedModelError, match="group expert_up_down"):
        probe(model, wrong, expand(wrong, model), ids)


def test_per_expert_groups_are_validated():
    with pytest.raises(ValueError, match="per_expert"):
        GroupSpec("g", (Move("model.layers.{i}.mlp.experts.down_proj", expert=0), Move("model.layers.{i}.x.weight")),
                  per_block=True, per_expert=True)
    with pytest.raises(ValueError, match="Move.expert"):
        GroupSpec("g", (Move("model.layers.{i}.mlp.experts.down_proj", expert=0),), per_block=True)


@pytest.mark.parametrize("key", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_a_rescaled_model_saved_and_loaded_computes_the_same(key, tmp_path):
    """What moved must survive save_pretrained/from_pretrained: the fused expert tensors and the eps in the
    config. DeepSeek's MLA norms take eps 1e-6 from the code, not the config, so a moved MLA eps would be
    lost on loading: it must not move (`fixed` in the family's EpsScope), even where it equals `rms_norm_eps`."""
    model = make_tiny(key)
    ids = tiny_ids(model, length=16)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    apply_exponents_(model, family, groups, random_exponents(groups, 2) | {"residual": -5})
    fixed = [m for n, m in model.named_modules() if n.endswith(family.eps[0].fixed or ("-",))]
    assert all(m.variance_epsilon == 1e-6 for m in fixed) and (bool(fixed) == key.startswith("deepseek"))
    model.save_pretrained(tmp_path)
    loaded = model_class_for(model.config).from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert _rel(logits(loaded, ids), logits(model, ids)) < 1e-6


@pytest.mark.parametrize("key", ["mixtral", "gpt_oss"])
def test_fp32_residual_and_clamp_baselines_run_on_moe_blocks(key):
    model = make_tiny(key)
    ids = tiny_ids(model, length=16)
    ref = logits(model, ids)
    half = cast_copy(model, torch.float16)
    with keep_residual_fp32(half):
        assert _rel(logits(half, ids).float(), ref) < 1e-2
    with clamp_residual_adds(half) as handle:
        assert _rel(logits(half, ids).float(), ref) < 1e-2
        assert handle.adds == 2 * model.config.num_hidden_layers


@pytest.mark.parametrize("key", ["qwen2_moe"])
def test_one_experts_overflow_is_seen_and_fixed_by_its_own_pair(key):
    """Fused experts run inside one module; the scan recomputes each expert's gated product (the input of
    its down projection), so an overflow in one expert is seen, and the plan moves that expert's pair."""
    model = make_tiny(key)
    ids = tiny_ids(model, length=16)
    family = family_for(model.config.model_type)
    expand(family, model)  # the groups are valid here
    site, group = "model.layers.1.mlp.experts:expert2", "expert_up_down@model.layers.1#2"
    peak = scan(model, [ids], progress=False).sites[site].abs_max
    k = math.ceil(math.log2(4 * 65504 / peak))
    # A stress model (not a rescale of the tiny one): expert 2's up rows x 2**k, its down_proj as it was.
    model.get_parameter("model.layers.1.mlp.experts.gate_up_proj").data[2, model.config.get_text_config().moe_intermediate_size
                                                                      if key != "mixtral" else model.config.intermediate_size:] *= 2.0 ** k
    ref = logits(model, ids)
    report = scan(model, [ids], progress=False)
    assert report.sites[site].abs_max > 65504 and report.peak.name in (site, site + ".up")
    assert not torch.isfinite(logits(cast_copy(model, torch.float16), ids)).all()
    converted = make_fp16_safe(model, samples=[ids], progress=False)
    experts = {g: e for g, e in converted.plan.exponents.items() if g.startswith("expert_up_down") and e}
    assert experts.keys() == {group} and experts[group] <= -2
    out = logits(cast_copy(model, torch.float16), ids).float()
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2


def test_weight_limits_are_per_expert_part():
    """A fused tensor moved in parts is limited part by part: expert 2's large up rows cap expert 2's pair, not
    the sum of every expert's exponent on the whole tensor's peak."""
    model = make_tiny("mixtral")
    family = family_for("mixtral")
    groups = expand(family, model)
    params = dict(model.named_parameters())
    params["model.layers.1.mlp.experts.gate_up_proj"].data[2, 64:] *= 2.0 ** 20
    limits = {c.site: c for c in constraints_from({}, {}, groups, params)}
    up2 = limits["weight:model.layers.1.mlp.experts.gate_up_proj[dim 0 [2:3], dim 1 [64:128]]"]
    assert up2.powers == {"expert_up_down@model.layers.1#2": 1} and up2.log2_peak > 14
    up0 = limits["weight:model.layers.1.mlp.experts.gate_up_proj[dim 0 [0:1], dim 1 [64:128]]"]
    assert up0.powers == {"expert_up_down@model.layers.1#0": 1} and up0.log2_peak < 0
    down0 = limits["weight:model.layers.1.mlp.experts.down_proj[dim 0 [0:1]]"]
    assert down0.powers == {"residual": 1, "expert_up_down@model.layers.1#0": -1}
    exps = solve(groups, list(limits.values()), headroom_bits=2)
    expected = math.floor(math.log2(65504) - 2 - up2.log2_peak)  # -3 here
    assert {g: e for g, e in exps.items() if e} == {"expert_up_down@model.layers.1#2": expected}
