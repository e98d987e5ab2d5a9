"""Which safetensors files of a folder are the model's weights: exactly the ones transformers' loader reads.

transformers (modeling_utils._get_resolved_checkpoint_files, then _load_pretrained_model) takes config.json's
`transformers_weights` where it names a file; else `model.safetensors` where it is a file; else the files
`model.safetensors.index.json` names; then its config class's `extra_files` where present. It loads every tensor of
every file it takes, a later file's over an earlier's, and never looks at any other file. halfsafe reads the same
files and the same tensors on every path (streamed, whole, the checks before either), so what it measures and
converts is what transformers would load.

A folder that leaves the choice to an accident is refused in one line naming the files: a tensor stored in a file
transformers reads and again in another weight file beside it, with no index transformers reads that says which
holds it (`model.safetensors` beside `model-backup.safetensors`); a tensor two of the read files hold where the
index names the one transformers does not take; safetensors files and none that transformers would load.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import HalfsafeError
from ..files.model_folder import model_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")
HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header's size


def read_files(folder: Path) -> tuple[list[str], dict[str, str] | None, bool]:
    """The files transformers reads, in the order it merges them; the index's weight_map where it reads one; whether
    a file of the folder says which files those are (the index, or config.json's transformers_weights)."""
    folder = Path(folder)
    config = _config_json(folder)
    explicit = config.get("transformers_weights")
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise HalfsafeError(f"{folder / 'config.json'}'s transformers_weights is {explicit!r}, not the name of a "
                                ".safetensors or .safetensors.index.json file: fix it or remove the field")
        if model_file(folder, explicit) is None:
            raise HalfsafeError(f"{folder} is missing {explicit}, the weight file config.json's transformers_weights names: "
                                "copy it into the folder or fix the field")
        files, weight_map = _indexed(folder, explicit) if explicit.endswith(".json") else ([explicit], None)
        named = True
    elif model_file(folder, SINGLE) is not None:
        files, weight_map, named = [SINGLE], None, False
    elif model_file(folder, INDEX) is not None:
        files, weight_map = _indexed(folder, INDEX)
        named = True
    else:
        files, weight_map, named = [], None, False
    files += [f for f in _extra_files(config) if f not in files and model_file(folder, f) is not None]
    if not files:
        _refuse_unreadable(folder)
    return files, weight_map, named


def file_of_each_key(folder: Path) -> dict[str, str]:
    """key -> the file transformers takes it from (the last read file holding it), every read file checked as safetensors
    and the folder's other weight files checked for a copy of a read tensor (the refusals in the docstring)."""
    folder = Path(folder)
    files, weight_map, named = read_files(folder)
    holders: dict[str, list[str]] = {}
    for name in files:
        for key in header_keys(folder, name):
            holders.setdefault(key, []).append(name)
    for key, names in holders.items():
        if len(names) > 1 and (weight_map is None or weight_map.get(key) != names[-1]):
            said = f"; the index names {weight_map[key]}" if weight_map is not None and key in weight_map else ""
            raise HalfsafeError(f"{folder}: {' and '.join(names)} both hold {key}{said}, and transformers takes the copy in "
                                f"{names[-1]}: remove the duplicate or fix the index")
    if not named:  # no file says which files hold the weights: a copy in any other weight file is ambiguous
        for other in sorted(p.name for p in folder.glob("*.safetensors") if p.name not in files):
            both = sorted(k for k in header_keys(folder, other) if k in holders)
            if both:
                more = f" (and {len(both) - 1} more)" if len(both) > 1 else ""
                raise HalfsafeError(f"{folder}: {holders[both[0]][-1]} and {other} both hold {both[0]}{more}, and no index "
                                    f"says which is the model's (transformers loads {holders[both[0]][-1]}): move {other} "
                                    "out of the folder, or write model.safetensors.index.json")
    if weight_map is not None:
        lacking = sorted(k for k, f in weight_map.items() if k not in holders or f not in holders[k])
        if lacking:
            k = lacking[0]
            raise HalfsafeError(f"the index names {k} in {weight_map[k]}, which does not hold it: the checkpoint is "
                                "incomplete; re-download it")
    return {key: names[-1] for key, names in holders.items()}


def header_keys(folder: Path, name: str) -> list[str]:
    """The tensor names in the header of the safetensors file `name`, read from the header alone (nothing is mapped)."""
    path = model_file(folder, name)
    if path is None:
        raise HalfsafeError(f"{folder} is missing {name}, a weight file the checkpoint names: download every shard")
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > HEADER_LIMIT:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a map")
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise HalfsafeError(f"{folder / name} is not a readable safetensors file ({str(e)[:120] or type(e).__name__}): "
                            "re-download or re-save the checkpoint") from None
    return [k for k in header if k != "__metadata__"]


def _indexed(folder: Path, index_name: str) -> tuple[list[str], dict[str, str]]:
    index = model_file(folder, index_name)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise HalfsafeError(f"{index} is not a valid safetensors index: re-download or re-save the checkpoint") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise HalfsafeError(f"{index}'s weight_map is not a map of names to files: re-download or re-save the checkpoint")
    files = sorted(set(weight_map.values()))  # transformers' order (utils.hub.get_checkpoint_shard_files)
    absent = [f for f in files if model_file(folder, f) is None]
    if absent:
        raise HalfsafeError(f"{folder} is missing {absent[0]}, a weight shard its index names"
                            f"{f' (and {len(absent) - 1} more)' if len(absent) > 1 else ''}: download every shard")
    return files, dict(weight_map)


def _config_json(folder: Path) -> dict:
    """config.json as a dict; {} where it is absent or not a JSON object (the config reader refuses those)."""
    path = model_file(folder, "config.json")
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _extra_files(config: dict) -> tuple[str, ...]:
    """The weight files the config's class adds to what transformers reads (`PretrainedConfig.extra_files`)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return ()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return tuple(getattr(CONFIG_MAPPING[model_type], "extra_files", ()))
    except (KeyError, ImportError):
        return ()


def _refuse_unreadable(folder: Path) -> None:
    """No file transformers would load: why, in one line."""
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    loose = sorted(p.name for p in folder.glob("*.safetensors"))
    if loose:
        raise HalfsafeError(f"{folder} holds {loose[0]} but neither {SINGLE} nor {INDEX}, the files transformers loads "
                            f"weights from: rename a single file to {SINGLE}, or write the index of the shards")
    if pickled:
        raise HalfsafeError(
            f"{folder} holds only pickled weights ({pickled[0]}); halfsafe never unpickles. Convert them once "
            "with transformers: AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)")
    raise HalfsafeError(f"{folder} has no weights (*.safetensors): copy the weight files next to config.json")
