"""The ONNX exporters' registry (halfsafe.export.exporters): which exporter takes a model, read from its config and
the family data (Family.onnx), and the one-line refusal of a model no exporter takes. Configs only: nothing is
exported here."""

from __future__ import annotations

import inspect

import pytest
import transformers
from transformers import AutoConfig

from halfsafe.errors import UnsupportedModelError
from halfsafe.export import onnx_encoder
from halfsafe.export.contract import Exporter
from halfsafe.export.exporters import DECODER, EXPORTERS, exporter_for, kind_of, marked_kinds
from halfsafe.families import REGISTRY
from halfsafe.families.spec import ONNX_ENCODER, ONNX_SEQ2SEQ, Family, GroupSpec, Move, OnnxExport


def _config(model_type: str, **fields):
    config = AutoConfig.for_model(model_type, **fields)
    if marked_kinds().get(model_type) == ONNX_ENCODER:  # an encoder exports as one of the model classes it names
        config.architectures = [next(name for name in onnx_encoder.CLASSES
                                     if getattr(transformers, name).config_class is type(config))]
    return config


def test_every_exporter_fulfils_the_contract():
    wanted = {name for name, _ in inspect.getmembers(Exporter, inspect.isfunction) if not name.startswith("_")}
    assert wanted == {"check_exportable", "load_fp16", "programs", "finish"}
    for kind, exporter in EXPORTERS.items():
        missing = [name for name in wanted if not callable(getattr(exporter, name, None))]
        assert not missing, f"the {kind} exporter lacks {missing}"


def test_every_model_type_the_family_data_marks_reaches_its_exporter():
    marked = marked_kinds()
    assert set(marked.values()) == {ONNX_ENCODER, ONNX_SEQ2SEQ}
    assert {"bert", "roberta", "t5", "mt5", "bart", "pegasus"} <= set(marked)
    for model_type, kind in marked.items():
        family = REGISTRY[model_type]
        assert family.onnx is not None and family.onnx.kind == kind
        config = _config(model_type)
        assert kind_of(config) == kind
        assert exporter_for(config) is EXPORTERS[kind]


def test_a_causal_lm_takes_the_decoder_exporter_without_family_data():
    config = _config("llama")
    assert "llama" not in marked_kinds() and kind_of(config) == DECODER
    assert exporter_for(config) is EXPORTERS[DECODER]


def test_an_unmarked_encoder_decoder_is_refused_in_one_line_naming_the_fix():
    config = _config("umt5")  # in the t5 family, but its graphs are untested: the family data leaves it out
    assert config.is_encoder_decoder and "umt5" in REGISTRY["t5"].model_types
    with pytest.raises(UnsupportedModelError) as e:
        exporter_for(config)
    message = str(e.value)
    assert "\n" not in message and "umt5 is an encoder-decoder model" in message
    assert "exports bart, mt5, pegasus, t5" in message and "onnx=OnnxExport(ONNX_SEQ2SEQ)" in message


def test_a_marked_encoder_the_exporter_cannot_take_is_refused_in_one_line():
    config = _config("bert")
    config.architectures = ["BertForSequenceClassification"]
    with pytest.raises(UnsupportedModelError, match="(?s)^[^\n]*set `architectures` in config.json[^\n]*$"):
        exporter_for(config)


def _family(**onnx_fields) -> Family:
    group = GroupSpec("g", (Move("model.layers.{i}.w"),), per_block=True)
    return Family(name="f", model_types=("a", "b"), groups=(group,), residual_writers=(("o",),), **onnx_fields)


def test_the_family_data_onnx_field_is_checked_as_it_is_written():
    assert _family(onnx=OnnxExport(ONNX_SEQ2SEQ)).onnx_model_types == ("a", "b")
    assert _family(onnx=OnnxExport(ONNX_ENCODER, ("b",))).onnx_model_types == ("b",)
    assert _family().onnx_model_types == ()
    with pytest.raises(ValueError, match="kind must be one of"):
        OnnxExport("decoder")
    with pytest.raises(ValueError, match="not the family's model types"):
        _family(onnx=OnnxExport(ONNX_SEQ2SEQ, ("c",)))
    with pytest.raises(ValueError, match="onnx is an OnnxExport"):
        _family(onnx=ONNX_SEQ2SEQ)
