"""The probe on a shrunken random copy (halfsafe.shrink): what it finds, mapped onto the real model's groups, is
what probing the real model finds; the real model is never run; family data that does not hold is still refused;
a config that cannot be shrunk falls back to the real model, saying so."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config, GPTNeoXConfig

from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.forward import logits
from halfsafe.groups import expand, select_parts
from halfsafe.loading import load_model, model_class_for
from halfsafe.probe import probe
from halfsafe.stats import ActivationCollector
from halfsafe.shrink import map_governed, probe_governed, randomize_, shrunk_config, shrunk_model
from tests.tiny import TINY, make_tiny, save_tiny, tiny_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


FALLBACK: set[str] = set()  # tiny keys whose config cannot be shrunk (none today): they must probe the model itself


def _weight_dependent(model, groups, ids) -> tuple[set[str], set[str]]:
    """(sites the model measures, sites whose power depends on the weights). A site's power is that of its peak,
    which for these is the larger of activations that move differently, so which one wins depends on the weights, in
    the real model as in any copy: every site of a module run more than once per forward (T5's stack dropout, after
    the embedding and after the final norm) and the output of a module whose weight a group moves only in part (a
    fused projection: its power is a whole one only when its peak sits in the moved part; one expert's slice of a
    fused expert tensor is not such a part: its activations are measured per expert). A fused expert that no token
    reaches has no site in the model; the planner reads only measured sites."""
    calls: dict[str, int] = {}
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
               for n, m in model.named_modules() if n]
    try:
        with ActivationCollector(model) as c:
            logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    partial = {m.param.rsplit(".", 1)[0] for g in groups for m in g.moves
               if select_parts(m.select)[1 if g.expert is not None else 0:]}
    twice = {n for n, k in calls.items() if k > 1}
    return set(c.sites), {s for s in c.sites if s.rsplit(":", 1)[0] in twice} | {f"{n}:out" for n in partial}


def _settled(governed: dict, measured: set[str], skip: set[str]) -> dict:
    """governed without what depends on the weights (see _weight_dependent) and without power 0.0 (a tensor moved
    only in part: no constraint for the planner)."""
    return {g: {s: p for s, p in sites.items() if p and s in measured and s not in skip} for g, sites in governed.items()}


def _check_mapping(model, ids):
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    real = probe(model, family, groups, ids)
    small = shrunk_model(model, groups)
    small_groups = expand(family, small)
    mapped = map_governed(model, groups, small, small_groups, probe(small, family, small_groups, ids))
    measured, skip = _weight_dependent(model, groups, ids)
    assert mapped.keys() == real.keys()
    assert _settled(mapped, measured, skip) == _settled(real, measured, skip)
    return small


@pytest.mark.parametrize("key", sorted(TINY))
def test_shrunk_probe_mapped_equals_probing_the_model(key):
    model = make_tiny(key)
    ids = tiny_ids(model)
    if key in FALLBACK:
        with pytest.raises(UnsupportedModelError):
            shrunk_model(model, expand(family_for(model.config.model_type), model))
        return
    _check_mapping(model, ids)


def _deep(config, seed=0):
    torch.manual_seed(seed)
    return randomize_(model_class_for(config)(config).float(), seed)


# Deeper than the tiny models, with more experts, so that the shrunk copy has fewer blocks (and experts) than the
# model and the mapping is not the identity. key -> (config, blocks of the shrunk copy, as measured).
DEEP = {
    # 8 blocks: 3 sliding, 1 full, twice; the shrunk copy keeps the first blocks up to a middle full one, and the last
    "gemma3_text": (lambda: replace_layers("gemma3_text", 8, ["sliding_attention"] * 3 + ["full_attention"]), 5),
    # post-norm with {i+1} groups spanning two blocks, and the embedding norm reaching the first block only
    "bert": (lambda: replace_layers("bert", 6), 4),
    # 2 dense blocks then MoE, 8 experts (top-2): each real expert takes the shrunk expert e % 4
    "deepseek_v3": (lambda: DeepseekV3Config(**{**TINY["deepseek_v3"]().to_dict(), "num_hidden_layers": 6, "first_k_dense_replace": 2,
                                                "n_routed_experts": 8, "n_group": 2, "topk_group": 1}), 4),
    # per-expert groups of 8 experts
    "mixtral": (lambda: replace_layers("mixtral", 3, num_local_experts=8), 3),
    # shared KV: the last 3 of 7 blocks reuse the caches of the last sliding and last full block before them (every
    # block is of its own kind here: the copy keeps all 7, narrower)
    "gemma4_text": (lambda: replace_layers("gemma4_text", 7, ["sliding_attention", "sliding_attention", "full_attention"],
                                           num_kv_shared_layers=3), 7),
}


def replace_layers(key, n, pattern=None, **over):
    config = TINY[key]()
    d = {**config.to_dict(), **over}
    d["num_hidden_layers"] = n
    if pattern is not None:
        d["layer_types"] = [pattern[i % len(pattern)] for i in range(n - 1)] + ["full_attention"]
    if "per_layer_config" in d:  # Gemma 4: the full-attention blocks' own head width, made afresh for the new layer types
        d.pop("per_layer_config")
        d["global_head_dim"] = 32
    new = type(config).from_dict(d)
    new._attn_implementation = "eager"
    return new


@pytest.mark.parametrize("key", sorted(DEEP))
def test_deeper_models_map_onto_fewer_shrunk_blocks(key):
    make, blocks = DEEP[key]
    model = _deep(make())
    small = _check_mapping(model, tiny_ids(model))
    assert small.config.num_hidden_layers == blocks
    assert small.config.hidden_size < model.config.hidden_size


def test_probe_through_the_shrunk_copy_rejects_family_data_that_does_not_hold():
    model = make_tiny("llama")
    family = family_for("llama")
    vo = next(g for g in family.groups if g.name == "vo")
    moves = tuple(replace(m, power=1) if "o_proj" in m.param else m for m in vo.moves)  # o_proj moves with v_proj
    bad = replace(family, groups=tuple(replace(g, moves=moves) if g.name == "vo" else g for g in family.groups))
    with pytest.raises(UnsupportedModelError, match="does not hold"):
        probe_governed(model, bad, expand(bad, model), tiny_ids(model))


def test_streamed_model_is_never_run_by_the_probe(tmp_path):
    save_tiny("gemma3_text", tmp_path)
    loaded = load_model(tmp_path, stream=True)
    model, streamed = loaded.model, streamed_of(loaded.model)
    assert streamed is not None
    family = family_for(model.config.model_type)
    whole = make_tiny("gemma3_text")
    ids = tiny_ids(whole)
    governed = probe_governed(model, family, expand(family, model), ids)
    assert streamed.loads == 0, "the probe loaded weights of the real model"
    assert governed == probe_governed(whole, family, expand(family, whole), ids)


def test_a_config_that_cannot_be_shrunk_falls_back_to_the_model(caplog):
    # 32-wide heads with 2 rotary dims (rotary_pct 1/16); shrunk to 16-wide heads that would leave 1, which RoPE cannot
    d = TINY["gpt_neox"]().to_dict()
    config = GPTNeoXConfig(**{**d, "hidden_size": 128, "rope_parameters": {**d["rope_parameters"], "partial_rotary_factor": 0.0625}})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        shrunk_config(config)
    model = _deep(config)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    ids = tiny_ids(model)
    with caplog.at_level(logging.WARNING, logger="halfsafe.shrink"):
        governed = probe_governed(model, family, groups, ids)
    assert "partial_rotary_factor" in caplog.text and "probing the model itself" in caplog.text
    assert governed == probe(model, family, groups, ids)
