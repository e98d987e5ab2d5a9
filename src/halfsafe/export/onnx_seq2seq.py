"""fp16 ONNX of an encoder-decoder model (T5 v1.1 / Flan-T5 / mT5, BART, Pegasus) in the transformers.js layout.

Two graphs, each exported by transformers' OnnxExporter from the model loaded all-fp16, as `export/onnx_decoder.py`
does for decoders:
- `onnx/encoder_model_fp16.onnx`: input_ids, attention_mask -> last_hidden_state;
- `onnx/decoder_model_merged_fp16.onnx`: input_ids (the decoder's), encoder_attention_mask, encoder_hidden_states,
  past_key_values.{i}.decoder.key|value -> logits (float32, cast from fp16), present.{i}.decoder.key|value and
  present.{i}.encoder.key|value.
The decoder computes the cross-attention keys and values from encoder_hidden_states at every step (one matmul per
layer over the encoder's length) instead of reading them back: one graph without optimum's `use_cache_branch`
If node. transformers.js feeds a graph only the inputs it declares, and keeps the first step's
present.{i}.encoder.* as the cross-attention cache, so the client runs it unchanged.

BART's encoder layers end in an overflow fallback, `if fp16 and not torch.isfinite(h).all(): h = clamp(h, +-64504)`
(transformers/models/bart/modeling_bart.py, BartEncoderLayer.forward): a branch on the data, which torch.export cannot
trace (GuardOnDataDependentSymNode: Eq(u0, 1)). The graph is exported as that branch runs on finite activations, not
taken (`_finite_activations`): on a converted model, which does not overflow, it computes what transformers computes;
an unconverted one that overflows gives inf where transformers would clamp. Pegasus's encoder layers clamp to
+-64504 in fp16 unconditionally; the graph keeps those Clip nodes, as transformers computes them (they bind only
on activations past 64504, which a converted model does not reach).
"""

from __future__ import annotations

import json
import re
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

from ..errors import HalfsafeError, UnsupportedModelError
from ..io import card
from .onnx_common import EXPORTER, clip_nodes, float32_output, has_external_data, load_exportable_fp16, name_dims, run_exporter
from .onnx_folder import mark_config, mark_tokenizer

ENCODER_FILE = "onnx/encoder_model_fp16.onnx"
DECODER_FILE = "onnx/decoder_model_merged_fp16.onnx"
# the model types this layout takes are marked in the family data (Family.onnx); transformers.js (3.8.1, 4.3.2) runs
# all but Pegasus, which it has no class for
NO_JS_CLASS = ("pegasus",)

_ENCODER_DIMS = {
    "input_ids": ("batch_size", "encoder_sequence_length"),
    "attention_mask": ("batch_size", "encoder_sequence_length"),
    "last_hidden_state": ("batch_size", "encoder_sequence_length", None),
}
_DECODER_DIMS = {
    "input_ids": ("batch_size", "decoder_sequence_length"),
    "encoder_attention_mask": ("batch_size", "encoder_sequence_length"),
    "encoder_hidden_states": ("batch_size", "encoder_sequence_length", None),
    "logits": ("batch_size", "decoder_sequence_length", None),
    "past_key_values.decoder": ("batch_size", None, "past_decoder_sequence_length", None),
    "present.decoder": ("batch_size", None, "total_decoder_sequence_length", None),
    "present.encoder": ("batch_size", None, "encoder_sequence_length", None),
}
_CACHE = re.compile(r"^(?:input\.|output\.)?(?:cache|past_key_values)\.(self|cross)_attention_cache\.layers\.(\d+)\.(keys|values)$")


def check_exportable(config) -> None:
    """Only an encoder-decoder model; which model types export in this layout the registry reads from the family data
    (halfsafe.export.exporters)."""
    if not getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{getattr(config, 'model_type', '?')} is not an encoder-decoder model: the "
                                    f"encoder-decoder ONNX export ({EXPORTER}) takes one")


def load_fp16(folder: Path):
    from transformers import AutoModelForSeq2SeqLM

    return load_exportable_fp16(folder, check_exportable, AutoModelForSeq2SeqLM)


def kv_shape(config) -> tuple[int, int, int]:
    layers = getattr(config, "num_decoder_layers", None) or getattr(config, "decoder_layers", None) or config.num_layers
    heads = getattr(config, "num_heads", None) or config.decoder_attention_heads
    d_kv = getattr(config, "d_kv", None) or config.d_model // heads
    return layers, heads, d_kv


class _AllFinite:
    def all(self) -> bool:
        return True


class _TorchFiniteActivations(types.ModuleType):
    """torch, but `torch.isfinite(x).all()` is True: in a modeling module's namespace while it is exported."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def isfinite(x):
        return _AllFinite()


@contextmanager
def _finite_activations(module):
    """Export `module` as its overflow fallbacks (`if not torch.isfinite(h).all(): clamp`) run on finite activations."""
    modeling = sys.modules[type(module).__module__]
    if getattr(modeling, "torch", None) is not torch:
        yield
        return
    with mock.patch.object(modeling, "torch", _TorchFiniteActivations("torch")):
        yield


def _export(module, inputs: dict, shapes: dict, name: str):
    return run_exporter(module, inputs, shapes, f"the {name} of {module.config.model_type}", _finite_activations(module))


def encoder_program(model, batch: int = 2, length: int = 5):
    from torch.export import Dim

    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (batch, length), generator=g),
              "attention_mask": torch.ones(batch, length, dtype=torch.long)}
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    program = _export(model.get_encoder(), inputs, {"input_ids": auto, "attention_mask": auto}, "encoder")
    graph = program.graph
    odd = [v.name for v in list(graph.inputs) + list(graph.outputs) if v.name not in _ENCODER_DIMS]
    if odd:
        raise HalfsafeError(f"unexpected encoder inputs/outputs from {EXPORTER}: {odd[:4]} (please report this)")
    name_dims(graph, _ENCODER_DIMS)
    return program


def decoder_program(model, batch: int = 2, length: int = 5, past: int = 3, new: int = 2):
    """The decoder with a self-attention cache; cross-attention keys and values computed from encoder_hidden_states."""
    from torch.export import Dim
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    layers, heads, d_kv = kv_shape(model.config)
    g = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    self_cache = DynamicCache()
    for i in range(layers):
        self_cache.update(torch.randn(batch, heads, past, d_kv, generator=g).to(dtype),
                          torch.randn(batch, heads, past, d_kv, generator=g).to(dtype), i)
    hidden = torch.randn(batch, length, model.config.d_model, generator=g).to(dtype)
    inputs = {
        "decoder_input_ids": torch.randint(0, model.config.vocab_size, (batch, new), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "encoder_outputs": BaseModelOutput(last_hidden_state=hidden),
        "past_key_values": EncoderDecoderCache(self_cache, DynamicCache()),
    }
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    shapes = {"decoder_input_ids": auto, "attention_mask": auto, "encoder_outputs": [auto],
              "past_key_values": [{0: Dim.AUTO, 2: Dim.AUTO}] * (2 * layers)}
    program = _export(model, inputs, shapes, "decoder")
    graph = program.graph
    _rename_decoder_io(graph)
    table = {**_DECODER_DIMS}
    for v in list(graph.inputs) + list(graph.outputs):
        parts = v.name.split(".")
        if len(parts) == 4:  # past_key_values.{i}.decoder.key -> past_key_values.decoder
            table[v.name] = _DECODER_DIMS[f"{parts[0]}.{parts[2]}"]
    name_dims(graph, table)
    float32_output(graph)
    return program


def _rename_decoder_io(graph) -> None:
    renames = {"decoder_input_ids": "input_ids", "attention_mask": "encoder_attention_mask",
               "encoder_outputs.last_hidden_state": "encoder_hidden_states"}
    for value in graph.inputs:
        m = _CACHE.match(value.name)
        if m:
            value.name = f"past_key_values.{m.group(2)}.decoder.{'key' if m.group(3) == 'keys' else 'value'}"
        elif value.name in renames:
            value.name = renames[value.name]
    # the encoder's output passed through is no output of transformers.js's decoder
    for i in reversed(range(len(graph.outputs))):
        if graph.outputs[i].name == "encoder_last_hidden_state":
            graph.outputs.pop(i)
    for value in graph.outputs:
        m = _CACHE.match(value.name)
        if m:
            value.name = f"present.{m.group(2)}.{'decoder' if m.group(1) == 'self' else 'encoder'}.{'key' if m.group(3) == 'keys' else 'value'}"
    names = [v.name for v in list(graph.inputs) + list(graph.outputs)]
    expected = re.compile(r"^(input_ids|encoder_attention_mask|encoder_hidden_states|logits|"
                          r"past_key_values\.\d+\.decoder\.(key|value)|present\.\d+\.(decoder|encoder)\.(key|value))$")
    odd = [n for n in names if not expected.match(n)]
    if odd:
        raise HalfsafeError(f"unexpected decoder inputs/outputs from {EXPORTER}: {odd[:4]} (please report this)")


def programs(model):
    """The encoder, then the merged decoder (one graph in memory at a time)."""
    yield ENCODER_FILE, encoder_program(model)
    yield DECODER_FILE, decoder_program(model)


def finish(folder: Path, name: str | None = None) -> None:
    if (folder / "config.json").is_file():
        external = [Path(f).name for f in (ENCODER_FILE, DECODER_FILE) if has_external_data(folder / f)]
        mark_config(folder, external)
    mark_tokenizer(folder)
    model_type = json.loads((folder / "config.json").read_text()).get("model_type") if (folder / "config.json").is_file() else None
    files = [ENCODER_FILE, DECODER_FILE]
    card.write_onnx(folder, files, clip_nodes(folder, files), task="text2text-generation",
                    no_js_class=model_type if model_type in NO_JS_CLASS else None, name=name)
