"""The block-by-block engine (halfsafe.engine): a streamed model computes, rescales and writes exactly what the
whole model in memory does, holding one unit's weights at a time; bad checkpoints fail before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.rewrite import apply_exponents_, trial
from halfsafe.engine.precision import in_dtype
from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import HalfsafeError
from halfsafe.families import family_for
from halfsafe.io.checkpoint import save_fp16_checkpoint
from halfsafe.io.loading import load_model
from tests.same_run import assert_same_run
from tests.tiny import TINY, loaded_whole, random_exponents, save_tiny, tiny_ids


def _pair(key: str, folder: Path):
    save_tiny(key, folder)
    return load_model(folder).model, load_model(folder, stream=True).model


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module", params=sorted(TINY))
def pair(request, tmp_path_factory):
    key = request.param
    whole, streamed = _pair(key, tmp_path_factory.mktemp(key.replace("/", "_")))
    return key, whole, streamed


def test_the_families_loaded_whole_are_those_whose_data_moves_experts_one_by_one():
    """transformers saves these mixture-of-experts models' fused expert tensors one tensor per expert and merges them
    on load, so the engine loads them whole (renamed layouts, GPT-NeoX's embed_out or Gemma 3's language_model.*,
    stream); their family data has per-expert groups. A transformers that saves one differently shows here."""
    per_expert = {k for k, config in TINY.items() if any(g.per_expert for g in family_for(config().model_type).groups)}
    assert loaded_whole() == per_expert and len(TINY) - len(per_expert) > 30


def test_streams_every_family_whose_checkpoint_maps_one_to_one(pair):
    key, whole, streamed = pair
    assert (streamed_of(streamed) is None) == (key in loaded_whole()), "loading and engine.streamed.loads_whole disagree"
    if streamed_of(streamed) is not None:
        assert all(p.device.type == "meta" for p in streamed.parameters()), "a streamed model holds no weights at rest"


def test_streamed_model_computes_the_whole_models_logits_fp32_and_fp16(pair):
    key, whole, streamed = pair
    if streamed_of(streamed) is None:
        pytest.skip("loaded whole")
    ids = tiny_ids(whole, 12)
    assert_same_run(logits(whole, ids), logits(streamed, ids), "fp32 runs")
    with in_dtype(whole, torch.float16) as a, in_dtype(streamed, torch.float16) as b:
        assert_same_run(logits(a, ids), logits(b, ids), "fp16 runs")
    assert next(streamed.parameters()).dtype == torch.float32, "in_dtype restored the placeholders"


def test_trial_on_streamed_model_matches_in_memory_rescale_and_undoes(pair):
    key, whole, streamed = pair
    if streamed_of(streamed) is None:
        pytest.skip("loaded whole")
    family = family_for(whole.config.model_type)
    exps = random_exponents(expand(family, whole), seed=3)
    ids = tiny_ids(whole, 12)
    before = logits(streamed, ids)
    with trial(whole, family, expand(family, whole), exps), trial(streamed, family, expand(family, streamed), exps):
        assert_same_run(logits(whole, ids), logits(streamed, ids), "fp32 runs")
        assert streamed_of(streamed).rescale, "the rescale table is set during the trial"
    assert not streamed_of(streamed).rescale
    assert torch.equal(logits(streamed, ids), before)


def test_streamed_write_is_bit_identical_to_whole_model_save(pair, tmp_path):
    key, whole, streamed = pair
    family = family_for(whole.config.model_type)
    exps = random_exponents(expand(family, whole), seed=5, choices=(-2, -1, 1))
    apply_exponents_(whole, family, expand(family, whole), exps)
    apply_exponents_(streamed, family, expand(family, streamed), exps)
    try:
        save_fp16_checkpoint(whole, None, tmp_path / "whole", None)
        save_fp16_checkpoint(streamed, None, tmp_path / "streamed", None)
    finally:
        apply_exponents_(whole, family, expand(family, whole), {k: -v for k, v in exps.items()})
        apply_exponents_(streamed, family, expand(family, streamed), {k: -v for k, v in exps.items()})
    assert whole.dtype == torch.float32, "saving left the caller's model as it was"
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "streamed")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if streamed_of(streamed) is not None:
        assert (tmp_path / "whole/model.safetensors").read_bytes() == (tmp_path / "streamed/model.safetensors").read_bytes()
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("whole", "streamed"))
    assert ca == cb


def test_a_weight_past_65504_is_refused_by_either_write(tmp_path):
    """Finite in float32, inf once written in float16: both writes refuse it, naming it, and leave no folder."""
    whole, streamed = _pair("llama", tmp_path / "src")
    for name, model in (("whole", whole), ("streamed", streamed)):
        family = family_for(model.config.model_type)
        groups = expand(family, model)
        exps = {groups[0].name: 20}  # 2^20 x weights of about 0.02: far past 65504
        apply_exponents_(model, family, groups, exps)
        try:
            with pytest.raises(HalfsafeError, match="non-finite weights in"):
                save_fp16_checkpoint(model, None, tmp_path / name, None)
        finally:
            apply_exponents_(model, family, groups, {k: -v for k, v in exps.items()})
        assert not (tmp_path / name).exists()


def test_one_unit_resident_at_a_time(tmp_path):
    whole, streamed = _pair("llama", tmp_path)
    s = streamed_of(streamed)
    loaded_now = []

    def count(*_):
        loaded_now.append(sum(p.numel() for p in streamed.parameters() if p.device.type != "meta"))

    for name in s.units:
        streamed.get_submodule(name).register_forward_hook(count)
    logits(streamed, tiny_ids(whole, 8))
    size = {u: sum(p.numel() for p in streamed.get_submodule(u).parameters()) for u in s.units}
    stem = sum(p.numel() for n, p in whole.named_parameters() if not n.startswith("model.layers."))
    block = max(size[u] for u in s.units if u.startswith("model.layers."))
    assert loaded_now and max(loaded_now) <= stem + block < sum(p.numel() for p in whole.parameters())
    assert all(p.device.type == "meta" for p in streamed.parameters()), "everything freed after the forward"
    assert s.loads == len(list(whole.parameters())), "each weight read once per forward (a tied one once)"


def test_sharded_output_with_index_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    whole, streamed = _pair("llama", tmp_path / "src")
    save_fp16_checkpoint(streamed, None, tmp_path / "out", None, max_shard_size=20_000)
    index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float16)
    ids = tiny_ids(whole, 8)
    with in_dtype(whole, torch.float16) as half:
        assert torch.equal(logits(again, ids), logits(half, ids))
    streamed_again = load_model(tmp_path / "out", stream=True).model  # a sharded folder streams too
    assert streamed_of(streamed_again) is not None


def test_default_shard_size_is_the_hubs_5gb_in_the_api_and_the_cli():
    from huggingface_hub.serialization._base import MAX_SHARD_SIZE

    from halfsafe.cli import build_parser
    from halfsafe.engine.write import DEFAULT_MAX_SHARD_SIZE
    from halfsafe.io.checkpoint import shard_size

    assert shard_size(DEFAULT_MAX_SHARD_SIZE) == shard_size(MAX_SHARD_SIZE) == 5 * 10**9
    assert build_parser().parse_args(["convert", "m", "out"]).max_shard_size == 5 * 10**9


@pytest.mark.parametrize("key", ["qwen3", "gemma3", "gpt_neox"])  # stored names as the model's, renamed, renamed apart
def test_past_the_limit_streamed_and_whole_write_the_same_shards_and_index(key, tmp_path):
    """A checkpoint bigger than the (test-sized) limit: the streamed writer's shards and index are save_pretrained's,
    byte for byte, and transformers loads them; under the limit both write one model.safetensors, no index."""
    from halfsafe.io.loading import model_class_for

    whole, streamed = _pair(key, tmp_path / "src")
    limit = (tmp_path / "src/model.safetensors").stat().st_size // 2  # float32 source: the fp16 output is about one half
    for name, model in (("whole", whole), ("streamed", streamed)):
        save_fp16_checkpoint(model, None, tmp_path / name, None, max_shard_size=limit // 3)
        save_fp16_checkpoint(model, None, tmp_path / f"{name}-one", None, max_shard_size=limit * 2)
    files = sorted(p.name for p in (tmp_path / "whole").iterdir() if "safetensors" in p.name)
    assert len(files) > 3 and "model.safetensors.index.json" in files
    assert files == sorted(p.name for p in (tmp_path / "streamed").iterdir() if "safetensors" in p.name)
    for f in files:
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "streamed" / f).read_bytes(), f
    for name in ("whole-one", "streamed-one"):
        assert sorted(p.name for p in (tmp_path / name).iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    assert (tmp_path / "whole-one/model.safetensors").read_bytes() == (tmp_path / "streamed-one/model.safetensors").read_bytes()
    cls = model_class_for(whole.config)
    again = cls.from_pretrained(tmp_path / "streamed", dtype=torch.float16)  # transformers' own loader, from the index
    one = cls.from_pretrained(tmp_path / "streamed-one", dtype=torch.float16)
    ids = tiny_ids(whole, 8)
    assert torch.equal(logits(again, ids), logits(one, ids))


def test_bad_checkpoints_fail_in_one_line(tmp_path):
    save_tiny("llama", tmp_path / "m")
    whole = load_model(tmp_path / "m").model
    whole.save_pretrained(tmp_path / "sharded", max_shard_size=20_000)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(HalfsafeError, match="missing model-00002"):
        load_model(tmp_path / "sharded", stream=True)
    (tmp_path / "m/model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(HalfsafeError, match="not a readable safetensors file"):
        load_model(tmp_path / "m", stream=True)
    (tmp_path / "m/model.safetensors").unlink()
    torch.save({}, tmp_path / "m/pytorch_model.bin")
    with pytest.raises(HalfsafeError, match="never unpickles"):
        load_model(tmp_path / "m")
