"""Write a model's weights and config as an fp16 checkpoint (`save_fp16`); a streamed model one tensor at a time.

Every tensor of a streamed model is read once from its source shard, rescaled by the current table, cast to float16
and written straight into its place in the output shard, so memory holds one tensor, whatever the model's size. A
thread hashes and writes each file's bytes while the next tensor is computed, past the page cache where the file
system allows (engine.file_out). The files are laid out as `safetensors.save_file` lays them out (header order,
alignment, padding), sharded as transformers shards (`huggingface_hub.split_torch_state_dict_into_shards`, with an
index), with tied weights stored once.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from transformers.core_model_loading import dot_natural_key
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from halfsafe_serve.fingerprint import remember

from ..core.formats import all_finite
from ..errors import HalfsafeError
from ..progress import phase
from .choices import DEFAULT_MAX_SHARD_SIZE  # the hub's own default (engine.choices)
from .file_out import FileOut
from .precision import cast_copy
from .shards import row_spans
from .streamed import Streamed, saved_name, streamed_of

_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
          torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
# safetensors orders a file's tensors by dtype (its enum, largest first), then by name
_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]


def save_fp16(model, folder: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, progress: bool = False) -> None:
    """`model` as float16 weights and its configs in `folder` (the model is left as it is): a streamed model tensor by
    tensor from its shards, an in-memory one by `save_pretrained` of a float16 copy. A non-finite weight is refused."""
    streamed = streamed_of(model)
    if streamed is None:
        with phase("write", quiet=not progress):
            half = cast_copy(model, torch.float16)
            _refuse_nonfinite([n for n, p in half.named_parameters() if not all_finite(p)])
            half.save_pretrained(folder, max_shard_size=max_shard_size)
            del half
        return
    _refuse_nonfinite(write_weights(streamed, folder, max_shard_size, progress))
    dtype, architectures = model.config.dtype, model.config.architectures
    model.config.dtype, model.config.architectures = "float16", [type(model).__name__]  # as save_pretrained records them
    try:
        model.config.save_pretrained(folder)
        if model.can_generate():
            model.generation_config.save_pretrained(folder)
    finally:
        model.config.dtype, model.config.architectures = dtype, architectures


def _refuse_nonfinite(bad: list[str]) -> None:
    if bad:
        raise HalfsafeError(f"refusing to save: non-finite weights in {', '.join(bad[:3])} (please report this)")


def output_tensors(streamed: Streamed, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """name -> meta tensor of what save_pretrained would write: the state dict without tied copies, floating
    tensors in `dtype` (persistent buffers included, as stored)."""
    model = streamed.model
    state = remove_tied_weights_from_state_dict(model.state_dict(keep_vars=True), model)
    out = {}
    for name, t in state.items():
        out[name] = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
    return out


def saved_names(streamed: Streamed, layout: dict[str, torch.Tensor]) -> dict[str, str]:
    """model name -> the name save_pretrained stores it under."""
    out = {}
    for n, t in layout.items():
        key = saved_name(streamed.model, n, t.shape)
        if key is None:
            raise HalfsafeError(f"internal error: {n} has no one-to-one saved name; this checkpoint should not stream")
        out[n] = key
    return out


def write_weights(streamed: Streamed, folder: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                  progress: bool = True, dtype: torch.dtype = torch.float16) -> list[str]:
    """Write the rescaled weights into `folder` (shards and index as transformers writes them); returns the
    names of weights that came out non-finite (none, for a valid plan)."""
    model_layout = output_tensors(streamed, dtype)
    stored = saved_names(streamed, model_layout)
    # in the order save_pretrained splits a loaded model's tensors into shards (revert_weight_conversion sorts them)
    layout = {stored[n]: model_layout[n] for n in sorted(model_layout, key=dot_natural_key)}
    name_of = {v: k for k, v in stored.items()}
    split = split_torch_state_dict_into_shards(layout, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    params = dict(streamed.model.named_parameters())
    buffers = dict(streamed.model.named_buffers())
    bad: list[str] = []
    saved = streamed.dtype, streamed.device
    # a rescaled tensor is read in float32, rescaled and cast, as .half() of the rescaled model would; the others are
    # read straight into `dtype` (bfloat16 -> float16 in one rounding, the same bits, without a float32 copy)
    streamed.dtype, streamed.device = dtype, torch.device("cpu")
    streamed.clear_cache()
    try:
        # each tensor weighs its bytes (Gemma 3 270M's embedding is 62% of them)
        cost = sum(t.numel() * t.element_size() for t in layout.values())
        with phase("write", total=len(layout), unit="tensors", quiet=not progress, cost=cost) as bar:
            for filename, names in split.filename_to_tensors.items():
                _write_file(folder / filename, {n: layout[n] for n in names}, lambda n: _value(streamed, params, buffers, name_of[n], dtype, bad),
                            bar.advance)
    finally:
        streamed.dtype, streamed.device = saved
        streamed.clear_cache()
    if split.is_sharded:
        index = {"metadata": {"total_parameters": streamed.model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return bad


def _value(streamed: Streamed, params: dict, buffers: dict, name: str, dtype: torch.dtype, bad: list):
    """The tensor `name` as written, in parts of whole rows (one part, or chunks of a wide weight's rows): every
    part is rescaled in float32 and cast on its own, which is what casting the whole computes, element by element."""
    if name in params:
        if streamed._is_wide(name):
            wide = streamed.tensor(name)
            parts = (streamed.rows(name, a, b) for a, b in row_spans(wide.shape[0], wide.chunk_rows()))
        else:
            with streamed.shards:
                parts = [streamed.tensor(name)]
    else:
        parts = [buffers[name]]
    for t in parts:
        if t.is_floating_point():
            t = t.to(dtype)  # a rescaled float32 value (or a buffer) is cast and freed here: it and its copy at most
            if name not in bad and not all_finite(t):  # as written: a value past 65504 is inf there
                bad.append(name)
        yield t.contiguous()
    streamed.clear_cache()


def _write_file(path: Path, layout: dict[str, torch.Tensor], value, advance) -> None:
    """One safetensors file, header first, then each tensor's bytes as it is computed."""
    order = sorted(layout, key=lambda n: (-_ORDER.index(_NAMES[layout[n].dtype]), n))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in order:
        size = layout[n].numel() * layout[n].element_size()
        header[n] = {"dtype": _NAMES[layout[n].dtype], "shape": list(layout[n].shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    # hashed as the bytes go out, for halfsafe.json's fingerprint (never read back); written by a thread (file_out)
    with FileOut(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for n in order:
            rows, shape = 0, tuple(layout[n].shape)
            for t in value(n):  # whole rows, in order
                if tuple(t.shape[1:]) != shape[1:] or t.dtype != layout[n].dtype or (not shape and t.shape):
                    raise HalfsafeError(f"internal error: {n} is {tuple(t.shape)} {t.dtype}, expected {shape}")
                rows += t.shape[0] if shape else 1
                if t.numel():
                    f.write(t.view(-1).view(torch.uint8).numpy().data)  # copied into the file's staging block
            if rows != (shape[0] if shape else 1):
                raise HalfsafeError(f"internal error: {rows} rows written for {n}, expected {shape}")
            advance(1, layout[n].numel() * layout[n].element_size())
        digest = f.close()
    remember(path, digest)
