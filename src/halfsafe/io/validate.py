"""Input checks that run before the slow part: a config whose sizes agree with the weights' headers (checked before
anything is built from it), and weights that are all finite (shards this machine cannot map are refused as they are
opened: engine.shards). Each refusal is one line naming the file and the fix."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..core.formats import all_finite
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
    model = _meta_skeleton(config, cls, folder)
    refuse_missing(missing_weights(model, keys), str(folder))  # a weight transformers would fill in at random
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


def _meta_skeleton(config, cls, folder: Path):
    """The model `config` describes, without weights (its buffers are real: a size no memory holds fails here). A
    config transformers cannot build is refused now: every loader after this would fail on it too, some in a
    traceback from deep inside the model's constructor."""
    from accelerate import init_empty_weights

    try:
        with quiet_transformers(), init_empty_weights(include_buffers=False):
            return cls._from_config(config, dtype=torch.float32)
    except Exception as e:
        text = str(e).strip().splitlines()
        raise HalfsafeError(f"{Path(folder) / 'config.json'} describes a model transformers cannot build "
                            f"({(text[0] if text else type(e).__name__)[:200]}): fix config.json or re-download it") from None


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
                if not all_finite(f.get_slice(key)[a:b] if large else f.get_tensor(key)):
                    raise HalfsafeError(f"{folder} has non-finite weights in {key}: the checkpoint is corrupt; "
                                        "re-download or re-save it")


def check_finite_parameters(model, source: str) -> None:
    """The same check for a model loaded whole from a file halfsafe does not read itself (GGUF)."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not all_finite(p.detach()):
            raise HalfsafeError(f"{source} has non-finite weights in {name}: the checkpoint is corrupt; re-download or re-save it")


def missing_weights(model, stored) -> list[str]:
    """The parameters of `model` (a skeleton: meta weights will do) that a checkpoint holding the keys `stored` would
    leave for transformers to initialise at random: each stored key renamed as transformers' loader renames it (its
    weight conversions, the base model prefix added or dropped), then what transformers legitimately leaves unloaded
    set aside (`needed`). A weight transformers merges from several stored tensors (one per expert) is named by the
    stored tensors it lacks (`model.layers.0.mlp.experts.1.up_proj.weight`), as the checkpoint's files would name
    them. Empty for a complete checkpoint."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key, revert_weight_conversion

    mapping = get_model_conversion_mapping(model, None, None)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    missing, merged = set(expected), set()
    for key in stored:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:  # as transformers: a key that should not have been renamed
            renamed, pattern = rename_source_key(key, [], [], prefix, expected)
        missing.discard(renamed)
        if pattern is not None:
            merged.add(renamed)
    stored = set(stored)
    parts_of = {}
    for name in merged:  # made of several stored tensors (one per expert): all of them, or it is incomplete
        parts_of[name] = set(revert_weight_conversion(model, {name: expected[name]}))
        if parts_of[name] - stored:
            missing.add(name)
    out = []
    for name in needed(model, missing):  # a merged weight is named by the stored tensors it lacks, as the files name them
        parts = parts_of.get(name) or set(revert_weight_conversion(model, {name: expected[name]}))
        out += sorted(parts - stored) if len(parts) > 1 else [name]
    return out


def needed(model, missing) -> list[str]:
    """Of the state-dict names `missing` (never loaded), the parameters transformers would fill in at random: not a
    tied copy whose partner is loaded (transformers ties them, either way round), not a name the model class says
    may be absent (`_keys_to_ignore_on_load_missing`), not a buffer (computed by the model, never a weight)."""
    missing = set(missing)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[str, set[str]] = {}
    for target, source in tied.items():
        groups.setdefault(source, {source}).add(target)
    for group in groups.values():
        if group - missing:  # one of the tied names is loaded: every other is that same tensor
            missing -= group
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    ignore = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return sorted(n for n in missing if n in params and (ignore is None or not ignore.search(n)))


def refuse_missing(missing, where: str) -> None:
    """One line naming the first weight `where` lacks, before anything is computed from a model holding random values."""
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise HalfsafeError(f"{where} lacks {missing[0]}{more}, a weight the model needs: the checkpoint is incomplete "
                            "and halfsafe never lets a loader fill a weight in at random; re-download or re-save it")


def check_loading_info(model, info: dict, where: str) -> None:
    """The second line of defence, after a transformers load (`output_loading_info=True`): refuse a parameter it
    reports missing (and so initialised at random)."""
    refuse_missing(needed(model, info.get("missing_keys") or ()), where)
