"""Block placeholders beyond `{i}`: `{i+1}` (a per-block group reaching into the next block, as a post-norm
layer's last norm does) and `{last}` (the last block, in a whole-model group). Bad data fails loudly."""

from __future__ import annotations

import pytest
from tiny import make_tiny, tiny_ids
from transformers import BartConfig, BertConfig

from halfsafe.core.groups import expand
from halfsafe.core.probe import _passes, probe
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import Family, GroupSpec, Move, family_for
from halfsafe.io.loading import model_class_for

L, N, LAST = "bert.encoder.layer.{i}", "bert.encoder.layer.{i+1}", "bert.encoder.layer.{last}"


def _bert(layers: int = 3):
    config = BertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, max_position_embeddings=64, architectures=["BertForMaskedLM"])
    return model_class_for(config)(config).eval()


def _family(*groups: GroupSpec) -> Family:
    return Family(name="test", model_types=("test",), groups=groups)


@pytest.mark.parametrize("spec", [
    lambda: GroupSpec("g", (Move(f"{N}.output.dense.weight"),), per_block=True),  # no block of its own
    lambda: GroupSpec("g", (Move(f"{L}.output.LayerNorm.weight", optional=True), Move(f"{N}.output.dense.weight")),
                      per_block=True),
    lambda: GroupSpec("g", (Move(f"{N}.output.dense.weight"),)),  # {i+1} in a whole-model group
    lambda: GroupSpec("g", (Move(f"{L}.output.dense.weight"), Move(f"{LAST}.output.dense.bias")), per_block=True),
    lambda: GroupSpec("g", (Move("bert.encoder.layer.{i-1}.output.dense.weight"),)),
    lambda: GroupSpec("g", (Move("bert.encoder.layer.{i}.x.{i}.weight"),)),
])
def test_bad_placeholders_are_refused(spec):
    with pytest.raises(ValueError):
        spec()


def test_next_block_groups_span_two_blocks_and_stop_before_the_last():
    model = _bert(3)
    groups = [g for g in expand(family_for("bert"), model) if g.spec == "ln_out"]
    assert [g.blocks for g in groups] == [("bert.encoder.layer.0", "bert.encoder.layer.1"),
                                          ("bert.encoder.layer.1", "bert.encoder.layer.2")]
    assert {m.param for m in groups[1].moves} >= {"bert.encoder.layer.1.output.LayerNorm.weight",
                                                  "bert.encoder.layer.2.attention.self.query.weight"}
    assert len(_passes(groups)) == 2  # neighbours share a block: probed apart
    last = next(g for g in expand(family_for("bert"), model) if g.spec == "ln_last")
    assert "bert.encoder.layer.2.output.LayerNorm.weight" in {m.param for m in last.moves}
    one = expand(family_for("bert"), _bert(1))  # no block has a successor: no ln_out group, no error
    assert not [g for g in one if g.spec == "ln_out"] and [g for g in one if g.spec == "ln_last"]


def test_probe_attributes_both_blocks_of_a_spanning_group():
    model = make_tiny("bert")
    family = family_for("bert")
    groups = expand(family, model)
    moved = probe(model, family, groups, tiny_ids(model))["ln_out@bert.encoder.layer.0"]
    assert moved["bert.encoder.layer.0:out"] == 1
    assert moved["bert.encoder.layer.1.attention.output.LayerNorm:in"] == 1
    assert not any(s.startswith("bert.encoder.layer.1.output") for s in moved)


def test_next_block_template_matching_only_some_blocks_fails():
    model = _bert(3)
    model.bert.encoder.layer[2].attention.self.query.bias = None  # a layer laid out differently
    spec = GroupSpec("g", (Move(f"{L}.output.LayerNorm.weight"), Move(f"{N}.attention.self.query.bias")), per_block=True)
    with pytest.raises(UnsupportedModelError, match="matches blocks"):
        expand(_family(spec), model)
    optional = GroupSpec("g", (Move(f"{L}.output.LayerNorm.weight"),
                               Move(f"{N}.attention.self.query.bias", optional=True)), per_block=True)
    assert len(expand(_family(optional), model)) == 2  # an optional one may be absent


def test_last_must_be_the_last_block():
    model = _bert(3)
    spec = GroupSpec("g", (Move(f"{LAST}.output.LayerNorm.weight"),))
    (group,) = expand(_family(spec), model)
    assert [m.param for m in group.moves] == ["bert.encoder.layer.2.output.LayerNorm.weight"]
    model.bert.encoder.layer[2].output.LayerNorm.bias = None
    with pytest.raises(UnsupportedModelError, match="has 3 blocks"):
        expand(_family(GroupSpec("g", (Move(f"{LAST}.output.LayerNorm.bias"),))), model)


def test_whole_model_group_may_read_lists_of_different_depth_but_not_a_ragged_list():
    config = BartConfig(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        architectures=["BartForConditionalGeneration"])
    model = model_class_for(config)(config).eval()
    enc_out = next(g for g in expand(family_for("bart"), model) if g.name == "enc_out")
    assert sum(".encoder_attn.k_proj." in m.param for m in enc_out.moves) == 3
    assert "model.encoder.layers.1.final_layer_norm.weight" in {m.param for m in enc_out.moves}
    model.model.decoder.layers[2].encoder_attn.k_proj.bias = None
    ragged = GroupSpec("g", (Move("model.decoder.layers.{i}.encoder_attn.k_proj.weight"),
                             Move("model.decoder.layers.{i}.encoder_attn.k_proj.bias")))
    with pytest.raises(UnsupportedModelError, match="different blocks"):
        expand(_family(ragged), model)
