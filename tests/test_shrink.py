"""The probe on a shrunken random copy (halfsafe.core.shrink): what it finds, mapped onto the real model's groups, is
what probing the real model finds; the real model is never run; family data that does not hold is still refused;
a config that cannot be shrunk falls back to the real model, saying so."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config, GPTNeoXConfig

from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.probe import probe
from halfsafe.core.shrink import LAYER_FIELDS, map_governed, probe_governed, randomize_, shrunk_config, shrunk_model
from halfsafe.core.stats import ActivationCollector
from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.io.loading import load_model, model_class_for
from tests.tiny import TINY, make_tiny, save_tiny, tiny_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


FALLBACK: set[str] = set()  # tiny keys whose config cannot be shrunk (none today): they must probe the model itself


def _measured(model, ids) -> set[str]:
    """The sites a forward of `model` measures (a fused expert no token reaches has none: the planner reads only
    measured sites)."""
    with ActivationCollector(model) as c:
        logits(model, ids)
    return set(c.sites)


def _settled(governed: dict, measured: set[str]) -> dict:
    """governed on the measured sites, without power 0.0 (a tensor moved only in part: no constraint for the
    planner, as a site no group moves)."""
    return {g: {s: p for s, p in sites.items() if p and s in measured} for g, sites in governed.items()}


def _check_mapping(model, ids):
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    real = probe(model, family, groups, ids)
    small = shrunk_model(model, groups)
    small_groups = expand(family, small)
    mapped = map_governed(model, groups, small, small_groups, probe(small, family, small_groups, ids))
    measured = _measured(model, ids)
    assert mapped.keys() == real.keys()
    assert _settled(mapped, measured) == _settled(real, measured)
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


DECODER_DEPTHS = ("decoder_layers", "num_decoder_layers")


def deepened(key: str, depth: int, decoder_depth: int, tie: bool | None):
    """TINY[key]'s config with `depth` blocks in each block list (`decoder_depth` in an encoder-decoder's decoder)
    and, unless None, the head tied or untied; per-layer lists made afresh (layer types repeat their pattern, the
    last block full attention as Gemma 3/4 require; Gemma 4's per-layer head widths recomputed)."""
    def walk(d: dict) -> dict:
        d = {k: walk(v) if isinstance(v, dict) and "model_type" in v else v for k, v in d.items()}
        for f in LAYER_FIELDS:
            if isinstance(d.get(f), int) and not isinstance(d[f], bool):
                d[f] = decoder_depth if f in DECODER_DEPTHS else depth
        n = d.get("num_hidden_layers", depth)
        if isinstance(d.get("layer_types"), list) and d["layer_types"]:
            pattern = d["layer_types"]
            d["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
            if "full_attention" in pattern:
                d["layer_types"][-1] = "full_attention"
        if "per_layer_config" in d:
            d.pop("per_layer_config")
        if isinstance(d.get("num_kv_shared_layers"), int):  # every shared type needs a block of it before the sharing
            k = min(d["num_kv_shared_layers"], n - 1)
            while k and set(d["layer_types"][: n - k]) != set(d["layer_types"]):
                k -= 1
            d["num_kv_shared_layers"] = k
        if isinstance(d.get("first_k_dense_replace"), int):
            d["first_k_dense_replace"] = min(d["first_k_dense_replace"], n - 1)
        if "attention_types" in d:  # GPT-Neo: [[pattern, repeats]] covering the blocks exactly
            pattern = d["attention_types"][0][0]
            d["attention_types"] = [[pattern, max(1, depth // len(pattern))]]
            d.pop("attention_layers", None)
            for f in LAYER_FIELDS:
                if isinstance(d.get(f), int):
                    d[f] = len(pattern) * max(1, depth // len(pattern))
        return d

    config = TINY[key]()
    d = walk(config.to_dict())
    if tie is not None:
        d["tie_word_embeddings"] = tie
        for sub in ("text_config", "decoder"):
            if isinstance(d.get(sub), dict):
                d[sub]["tie_word_embeddings"] = tie
    new = type(config).from_dict(d)
    new._attn_implementation = "eager"
    return new


def _draws(n: int = 2):
    """Seeded random (key, depth, decoder depth, tie) draws, n per family key: depths 1 to 8, encoder and decoder
    depths that differ, tied, untied and as-configured heads."""
    rng = random.Random(19)
    out = []
    for key in sorted(TINY):
        for _ in range(n):
            out.append((key, rng.randint(1, 8), rng.randint(1, 8), rng.choice([None, True, False])))
    return out


@pytest.mark.parametrize("key,depth,decoder_depth,tie", _draws())
def test_shrunk_probe_equals_probing_the_model_at_random_depths(key, depth, decoder_depth, tie):
    """The property the shrunk probe rests on, over every family at depths 1 to 8: the copy's result mapped onto
    the model is the model's own probe, site for site, power for power, for modules called more than once (T5's
    stack dropout), fused projections (GPT-2's c_attn), fused experts and heads tied or untied either way."""
    model = _deep(deepened(key, depth, decoder_depth, tie))
    ids = tiny_ids(model, length=16)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    mapped = probe_governed(model, family, groups, ids)
    real = probe(model, family, groups, ids)
    measured = _measured(model, ids)
    assert mapped.keys() == real.keys()
    assert _settled(mapped, measured) == _settled(real, measured)


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
    with caplog.at_level(logging.WARNING, logger="halfsafe.core.shrink"):
        governed = probe_governed(model, family, groups, ids)
    assert "partial_rotary_factor" in caplog.text and "probing the model itself" in caplog.text
    assert governed == probe(model, family, groups, ids)


def test_a_family_width_is_read_from_its_data():
    """A width only one family's configs name (DeepSeek's MLA ranks) comes from that family's `shrink_widths`,
    merged over the shared WIDTHS: without it the field keeps the model's value, with it the field takes it."""
    config = DeepseekV3Config(**{**TINY["deepseek_v3"]().to_dict(), "kv_lora_rank": 64, "hidden_size": 128})
    family = family_for("deepseek_v3")
    assert shrunk_config(config).kv_lora_rank == family.shrink_widths["kv_lora_rank"] == 16
    assert shrunk_config(config, family=replace(family, shrink_widths={**family.shrink_widths, "kv_lora_rank": 8})).kv_lora_rank == 8
    bare = shrunk_config(config, family=replace(family, shrink_widths={}))
    assert bare.kv_lora_rank == 64 and bare.hidden_size == 32  # the shared widths still shrink
