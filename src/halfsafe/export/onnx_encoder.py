"""fp16 ONNX of a BERT-style encoder (BERT, RoBERTa) in the transformers.js layout: `onnx/model_fp16.onnx`.

One graph, exported by transformers' OnnxExporter from the model loaded all-fp16, as `export/onnx_decoder.py` does
for decoders. Inputs as transformers.js's encoder forward feeds them: `input_ids`, `attention_mask`, and
`token_type_ids` where the model has token types (RoBERTa's single type has none, as in the onnx-community
exports; transformers.js fills zeros for a graph that declares it). Output by the model class: the bare model's
`last_hidden_state` (the feature-extraction pipeline reads it; the pooler output is left out, as optimum leaves
it out), a masked-LM head's `logits` (fill-mask), each cast to float32 at the end (Node has no Float16Array).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import HalfsafeError, UnsupportedModelError
from ..io import card
from .onnx_common import (
    EXPORTER,
    ONNX_FILE,
    clip_nodes,
    float32_output,
    has_external_data,
    load_exportable_fp16,
    name_dims,
    require_onnx,
    run_exporter,
)
from .onnx_folder import mark_config

# model class -> (its output the graph gives, the transformers.js pipeline that reads it)
CLASSES = {
    "BertModel": ("last_hidden_state", "feature-extraction"),
    "RobertaModel": ("last_hidden_state", "feature-extraction"),
    "BertForMaskedLM": ("logits", "fill-mask"),
    "RobertaForMaskedLM": ("logits", "fill-mask"),
}
_DIMS = ("batch_size", "sequence_length")


def _class_name(config) -> str:
    from ..io.loading import model_class_for

    return model_class_for(config).__name__


def check_exportable(config) -> None:
    name = _class_name(config)
    if name not in CLASSES:
        raise UnsupportedModelError(
            f"{config.model_type} ({name}) is not exported: the ONNX export ({EXPORTER}) of encoders covers "
            f"{', '.join(CLASSES)} (set `architectures` in config.json to one of them)"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(f"{config.model_type} configured as a decoder (is_decoder / add_cross_attention) "
                                    f"is not exported: the encoder export takes a plain encoder")


def load_fp16(folder: Path):
    return load_exportable_fp16(folder, check_exportable)


def _has_token_types(config) -> bool:
    return getattr(config, "type_vocab_size", 0) > 1


def output_of(config) -> str:
    return CLASSES[_class_name(config)][0]


def task_of(config) -> str:
    return CLASSES[_class_name(config)][1]


def export_program(model, batch: int = 2, length: int = 7):
    """The encoder graph: input_ids, attention_mask[, token_type_ids] -> float32 last_hidden_state or logits."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass
    from torch.export import Dim
    require_onnx()
    config = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, length, dtype=torch.long)}
    if _has_token_types(config):
        inputs["token_type_ids"] = torch.randint(0, config.type_vocab_size, (batch, length), generator=g)
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    program = run_exporter(model, inputs, {k: auto for k in inputs}, config.model_type)
    graph = program.graph
    want = output_of(config)
    for i in reversed(range(len(graph.outputs))):  # BertModel's pooler_output: not what transformers.js reads
        if graph.outputs[i].name != want:
            graph.outputs.pop(i)
    RemoveUnusedNodesPass()(program)
    names = [v.name for v in graph.inputs], [v.name for v in graph.outputs]
    if names != (list(inputs), [want]):
        raise HalfsafeError(f"unexpected encoder inputs/outputs from {EXPORTER}: {names} (please report this)")
    name_dims(graph, {**{k: _DIMS for k in inputs}, want: (*_DIMS, None)})
    float32_output(graph, want)
    return program


def programs(model):
    yield ONNX_FILE, export_program(model)


def finish(folder: Path, name: str | None = None) -> None:
    from ..io.loading import read_config

    config = read_config(folder)
    mark_config(folder, has_external_data(folder / ONNX_FILE), kv_cache=False)
    card.write_onnx(folder, [ONNX_FILE], clip_nodes(folder, [ONNX_FILE]), task=task_of(config), name=name)
