"""fp16 ONNX of a decoder-only causal LM in the transformers.js layout: `onnx/model_fp16.onnx`, with a KV cache.

Sample inputs with a KV cache and dynamic batch / sequence / past axes; graph inputs and outputs renamed to the names
ONNX Runtime GenAI-style and transformers.js decoders use (`input_ids`, `attention_mask`, `position_ids`,
`past_key_values.{i}.key|value` -> `logits`, `present.{i}.key|value`); float32 logits cast at the end.
"""

from __future__ import annotations

import re
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
from .onnx_folder import mark_config, mark_tokenizer

_CACHE_NAME = re.compile(r"^(?:input\.|output\.)?(?:cache|past_key_values)\.layers\.(\d+)\.(keys|values)$")
_IO_NAME = re.compile(r"^(input_ids|attention_mask|position_ids|logits|(past_key_values|present)\.\d+\.(key|value))$")

# The free dimensions as the onnx-community exports name them: transformers.js 4.x builds the empty KV cache from
# the session's input shapes, `batch_size` resolved to the batch and every other name to 0.
DIM_NAMES = {
    "input_ids": ("batch_size", "sequence_length"),
    "attention_mask": ("batch_size", "total_sequence_length"),
    "position_ids": ("batch_size", "sequence_length"),
    "past_key_values": ("batch_size", None, "past_sequence_length", None),
    "logits": ("batch_size", "sequence_length", None),
    "present": ("batch_size", None, "total_sequence_length", None),
}


def check_exportable(config) -> None:
    """Only decoder-only text generation (a causal LM with a KV cache) is exported."""
    from transformers import AutoModelForCausalLM

    from ..io.loading import model_class_for

    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{model_type} is an encoder-decoder model: the ONNX export ({EXPORTER}) here covers decoder-only text generation only"
        )
    cls = model_class_for(config)
    if cls not in AutoModelForCausalLM._model_mapping.values():
        raise UnsupportedModelError(
            f"{model_type} ({cls.__name__}) is not a causal LM: the ONNX export ({EXPORTER}) here covers decoder-only text generation only"
        )


def load_fp16(folder: Path):
    """The checkpoint in `folder` as an all-fp16 causal LM (no module kept in fp32), eval mode."""
    from transformers import AutoModelForCausalLM

    return load_exportable_fp16(folder, check_exportable, AutoModelForCausalLM)


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of the model's KV cache."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def sample_inputs(model, batch: int = 2, past: int = 3, new: int = 2) -> tuple[dict, dict]:
    """Forward kwargs for one decode step with a KV cache, and their dynamic axes.

    The cache holds every position for every layer (a plain DynamicCache, no per-layer sliding window): sliding
    layers are masked by position, so present = past + new for all layers, as transformers.js expects.
    """
    from torch.export import Dim
    from transformers import DynamicCache

    layers, kv_heads, head_dim = kv_shape(model.config)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    for i in range(layers):
        k = torch.randn(batch, kv_heads, past, head_dim, generator=g).to(dtype)
        v = torch.randn(batch, kv_heads, past, head_dim, generator=g).to(dtype)
        cache.update(k, v, i)
    vocab = model.config.get_text_config().vocab_size
    inputs = {
        "input_ids": torch.randint(0, vocab, (batch, new), generator=g),
        "attention_mask": torch.ones(batch, past + new, dtype=torch.long),
        "position_ids": torch.arange(past, past + new).expand(batch, new).contiguous(),
        "cache": cache,
        "use_cache": True,
    }
    # Dim.AUTO on the axes that vary: torch.export infers that the mask spans past + new itself.
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    shapes = {"input_ids": auto, "attention_mask": auto, "position_ids": auto, "cache": [{0: Dim.AUTO, 2: Dim.AUTO}] * (2 * layers)}
    return inputs, shapes


def _rename_io(graph) -> None:
    for value in list(graph.inputs) + list(graph.outputs):
        m = _CACHE_NAME.match(value.name)
        if m:
            kind = "key" if m.group(2) == "keys" else "value"
            prefix = "present" if value in graph.outputs else "past_key_values"
            value.name = f"{prefix}.{m.group(1)}.{kind}"
    names = [v.name for v in graph.inputs] + [v.name for v in graph.outputs]
    odd = [n for n in names if not _IO_NAME.match(n)]
    if odd:
        raise HalfsafeError(f"unexpected graph inputs/outputs from {EXPORTER}: {odd[:4]} (please report this)")


def export_program(model):
    """The fp16 ONNX graph (an `onnx_ir.Model`) of a causal LM, with a KV cache and transformers.js I/O names."""
    require_onnx()
    inputs, shapes = sample_inputs(model)
    program = run_exporter(model, inputs, shapes, model.config.model_type)
    _rename_io(program.graph)
    name_dims(program.graph, DIM_NAMES)
    float32_output(program.graph)
    return program


def programs(model):
    yield ONNX_FILE, export_program(model)


def finish(folder: Path, name: str | None = None) -> None:
    if (folder / "config.json").is_file():
        mark_config(folder, has_external_data(folder / ONNX_FILE))
    mark_tokenizer(folder)
    card.write_onnx(folder, [ONNX_FILE], clip_nodes(folder, [ONNX_FILE]), name=name)
