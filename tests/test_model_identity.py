"""The model halfsafe measures is the model transformers loads: for every tiny family and every way transformers
writes a checkpoint (the head as the config ties it, untied, tied in the config but stored apart with values of its
own, sharded), the streamed skeleton has from_pretrained's parameters, tied and untied as from_pretrained ties them,
reads their values from the checkpoint and computes the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from halfsafe.core.forward import logits
from halfsafe.engine.streamed import streamed_of
from halfsafe.io.loading import load_model
from tests.same_run import assert_same_run
from tests.tiny import TINY, make_tiny, tiny_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)

LAYOUTS = ("as-configured", "untied", "stored-apart", "sharded")


def _save(key: str, layout: str, folder) -> None:
    model = make_tiny(key, untie=layout in ("untied", "stored-apart"))
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if layout in ("untied", "stored-apart") and head is not None and embed is not None:
        with torch.no_grad():  # a head of its own (T5's config ties regardless: this unties it)
            head.weight = nn.Parameter((embed.weight.detach() + torch.randn_like(embed.weight) * 0.02).bfloat16().float())
    model.save_pretrained(folder, max_shard_size="20KB" if layout == "sharded" else "50GB")
    if layout == "stored-apart":  # the config says tied: from_pretrained sees two different tensors and unties
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["tie_word_embeddings"] = True
        for sub in ("text_config", "decoder"):
            if isinstance(config.get(sub), dict):
                config[sub]["tie_word_embeddings"] = True
        path.write_text(json.dumps(config))


def _sharing(model) -> dict[str, str]:
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def _cases():
    out = []
    for key in sorted(TINY):
        model = make_tiny(key)
        for layout in LAYOUTS:
            if layout in ("untied", "stored-apart") and model.get_output_embeddings() is None:
                continue  # no head to tie (encoders, embedding models)
            out.append((key, layout))
    return out


@pytest.mark.parametrize("key,layout", _cases())
def test_the_streamed_skeleton_is_what_from_pretrained_builds(key, layout, tmp_path):
    _save(key, layout, tmp_path)
    ref = load_model(tmp_path).model  # from_pretrained
    model = load_model(tmp_path, stream=True).model
    streamed = streamed_of(model)
    if streamed is None:
        pytest.skip("transformers merges this checkpoint's tensors on load: it is loaded whole, by from_pretrained")
    assert _sharing(model) == _sharing(ref), "tied and untied as from_pretrained ties them"
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    for name, key_ in streamed.key_of.items():  # every parameter read from the checkpoint tensor transformers reads
        assert torch.equal(streamed.shards.load(key_, torch.float32), ref.get_parameter(name).detach()), name
    ids = tiny_ids(ref, 12)
    assert_same_run(logits(ref, ids), logits(model, ids), "fp32 runs")


def test_a_head_stored_apart_under_a_tied_config_is_untied_as_transformers_does(tmp_path):
    """The case that was wrong: a T5 v1.1 checkpoint with its own lm_head and `tie_word_embeddings: true`."""
    _save("t5-v1_1", "stored-apart", tmp_path)
    ref, model = load_model(tmp_path).model, load_model(tmp_path, stream=True).model
    assert ref.lm_head.weight is not ref.shared.weight
    assert model.lm_head.weight is not model.shared.weight
    assert "lm_head.weight" in streamed_of(model).key_of
