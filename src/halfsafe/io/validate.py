"""Input checks that run before the slow part: a config whose sizes agree with the weights' headers (checked before
anything is built from it), and weights that are all finite (shards this machine cannot map are refused as they are
opened: engine.shards). Each refusal is one line naming the file and the fix."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..engine.shards import READ_BYTES, row_spans, rows_per_read
from ..errors import HalfsafeError
from .trust import quiet_transformers

CONFIG_SLACK = 2.0  # a model may hold this many times the elements its checkpoint stores (an untied head left out)
_LAYER_INDEX = re.compile(r"\.(\d+)(?=\.)")


def check_config(config, cls, shards, folder: Path) -> None:
    """The config's sizes against the shard headers: cheap counts first (no model is built from a config claiming
    100000 layers or a hidden size no weight has), then the meta skeleton's shapes and size against the headers."""
    text = config.get_text_config()
    keys = shards.keys()
    dims = {d for k in keys for d in shards.shape(k)}
    for name in ("hidden_size", "vocab_size"):
        value = getattr(text, name, None)
        if isinstance(value, int) and dims and value not in dims:
            raise _mismatch(folder, f"{name} {value}, a size no weight in the checkpoint has")
    layers = getattr(text, "num_hidden_layers", None)
    deepest = max((int(i) for k in keys for i in _LAYER_INDEX.findall(k)), default=None)
    if isinstance(layers, int) and deepest is not None and layers > deepest + 1:
        raise _mismatch(folder, f"num_hidden_layers {layers}, but the checkpoint stores layers up to {deepest}")
    model = _meta_skeleton(config, cls)
    if model is None:
        return
    prefix = getattr(model, "base_model_prefix", "") or ""
    elements = 0
    for name, p in model.named_parameters():
        elements += p.numel()
        stored = next((k for k in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")) if k in shards), None)
        if stored is not None and tuple(shards.shape(stored)) != tuple(p.shape):
            raise _mismatch(folder, f"a model whose {name} is {list(p.shape)}, but the checkpoint stores {list(shards.shape(stored))}")
    held = sum(math.prod(shards.shape(k)) for k in keys)
    if elements > CONFIG_SLACK * held + (1 << 20):
        raise _mismatch(folder, f"a model of {elements:,} weights, but the checkpoint holds {held:,}")


def _meta_skeleton(config, cls):
    from accelerate import init_empty_weights

    try:
        with quiet_transformers(), init_empty_weights(include_buffers=False):
            return cls._from_config(config, dtype=torch.float32)
    except Exception:  # a config transformers cannot build: its own loader says why, later
        return None


def _mismatch(folder: Path, what: str) -> HalfsafeError:
    return HalfsafeError(f"{Path(folder) / 'config.json'} describes {what}: config.json does not match the weights; "
                         "re-download the checkpoint or fix its config")


def check_finite(shards, folder: Path) -> None:
    """Every floating weight finite. Read in place from the mapped file (no copy), a tensor or a block of rows of a
    large one per opening, so no more than one block's pages are ever mapped."""
    from safetensors import safe_open

    for key in shards.keys():
        dtype, shape = shards.dtype(key), shards.shape(key)
        if not dtype.is_floating_point or not math.prod(shape):
            continue
        large = len(shape) >= 2 and math.prod(shape) * dtype.itemsize > READ_BYTES
        for a, b in row_spans(shape[0], rows_per_read(shape, dtype.itemsize)) if large else [(None, None)]:
            with safe_open(shards.path(key), "pt") as f:
                if not _finite(f.get_slice(key)[a:b] if large else f.get_tensor(key)):
                    raise HalfsafeError(f"{folder} has non-finite weights in {key}: the checkpoint is corrupt; "
                                        "re-download or re-save it")


def check_finite_parameters(model, source: str) -> None:
    """The same check for a model loaded whole from a file halfsafe does not read itself (GGUF)."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not _finite(p.detach()):
            raise HalfsafeError(f"{source} has non-finite weights in {name}: the checkpoint is corrupt; re-download or re-save it")


def _finite(t: torch.Tensor) -> bool:
    """min and max carry any NaN or inf (one pass, no temporary the size of `t`)."""
    if not t.numel():
        return True
    if t.dtype.itemsize == 1:  # float8: torch has no aminmax for these
        t = t.to(torch.float16)
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) & torch.isfinite(high))
