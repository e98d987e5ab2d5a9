"""Load a model from a folder, a GGUF file, a hub id already in the local cache, or the built-in fixture.

Never downloads: everything comes from disk, and only from inside the model's folder, and no code the folder ships
runs (`halfsafe.io.trust`). The input is checked before anything slow starts (`halfsafe.io.validate`). Every failure
becomes a one-line HalfsafeError.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from ..engine.device import resolve_device
from ..engine.shards import Shards
from ..engine.streamed import build
from ..errors import HalfsafeError, UnsupportedModelError
from .builtin import FIXTURE_DIRNAME, cache_dir, gemma3_270m_folder
from .config_fields import check_fields
from .paths import input_file
from .reading import LoadedModel, _first_line, load_gguf, load_tokenizer, load_tokenizer_folder, model_class_for
from .trust import check_folder, from_pretrained, model_file, quiet_transformers
from .validate import check_config, check_finite, check_loading_info

FIXTURE_NAMES = ("gemma3-270m",)


def load_model(source: str | os.PathLike, dtype: torch.dtype = torch.float32, stream: bool = False,
               device: "str | torch.device" = "auto", tokenizer: str | os.PathLike | None = None) -> LoadedModel:
    """Load `source` for measurement; weights in `dtype` (float32 by default: the reference). `stream`: keep the
    weights in the checkpoint and load one block at a time while the model runs (halfsafe.engine), where the
    checkpoint's layout allows; otherwise (and for GGUF) the whole model is loaded. `device` ("auto", "cpu", "cuda",
    "cuda:N"): where it computes, resolved here and only here (halfsafe.engine.device), for every kind of source.
    `tokenizer`: a folder to take the tokenizer from (--tokenizer) instead of the model's own; checked as a model
    folder is. The tokenizer otherwise comes from MODEL alone: its folder, or the GGUF file itself."""
    source, device = str(source), resolve_device(device)
    tok = Path(tokenizer).expanduser() if tokenizer is not None else None
    if source in FIXTURE_NAMES:
        return _load_folder(gemma3_270m_folder(), dtype, source, stream, device, tok)
    path = Path(source).expanduser()
    if path.suffix == ".gguf" and os.path.lexists(path):  # a FIFO or a device named *.gguf is refused, never opened
        return load_gguf(input_file(path, "the GGUF file", "give the .gguf file itself"), dtype, source, device, tok)
    if path.exists() and not path.is_dir():
        raise HalfsafeError(f"{source} is not a folder: give the model's folder (with config.json) or a .gguf file")
    if path.is_dir():
        return _load_folder(path, dtype, source, stream, device, tok)
    if _looks_like_hub_id(source):
        return _load_cached_hub_id(source, dtype, stream, device, tok)
    raise HalfsafeError(
        f"{source} does not exist: give a model folder, a .gguf file, a hub id already in the local cache, "
        f"or the built-in fixture name {FIXTURE_NAMES[0]!r}"
    )


def input_paths(source: str | os.PathLike) -> list[Path]:
    """What loading `source` reads from, as far as it is known before loading: the folder or file named, the
    fixture's folder. The writers keep their output out of these (`paths.refuse_overlap`)."""
    source = str(source)
    if source in FIXTURE_NAMES:
        return [cache_dir() / FIXTURE_DIRNAME]
    path = Path(source).expanduser()
    return [path] if path.exists() else []


def read_config(folder: Path) -> PretrainedConfig:
    """The folder's config; every folder halfsafe loads passes here first, so its trust checks run before transformers."""
    check_folder(folder)  # first: nothing is opened before every entry is known to be a file inside the folder
    config_file = model_file(folder, "config.json")
    if config_file is None:
        raise HalfsafeError(f"{folder} has no config.json: point at a Hugging Face model folder (config.json + *.safetensors)")
    try:
        check_fields(config_file, json.loads(config_file.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HalfsafeError(f"{config_file} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}): re-save or re-download it") from None
    except RecursionError:
        raise HalfsafeError(f"{config_file} nests too deep to be a config: re-save or re-download it") from None
    try:
        return from_pretrained(AutoConfig, folder, local_files_only=True)
    except StrictDataclassError as e:  # transformers' typed config refuses a field's value
        raise HalfsafeError(f"{config_file}: {_first_line(e).removeprefix('Validation error for ').rstrip(':')} holds a "
                            f"value of the wrong type ({_cause(e)}): fix that field in config.json or re-download it") from None
    except (ValueError, KeyError):
        model_type = json.loads(config_file.read_text()).get("model_type", "?")
        raise UnsupportedModelError(
            f"model_type {model_type!r} in {config_file} is unknown to transformers {transformers.__version__}: "
            "upgrade transformers or use a supported model"
        ) from None
    except OSError as e:
        raise HalfsafeError(f"could not read {config_file}: {_first_line(e)}") from None
    except Exception as e:  # transformers' own config code failing on a value no check above names
        raise HalfsafeError(f"transformers cannot read {config_file} ({_first_line(e)}): fix config.json or re-download "
                            "it") from None


def _cause(e: BaseException) -> str:
    """What a strict-dataclass validation error says of its field, in one line."""
    lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:160]


def _load_folder(folder: Path, dtype: torch.dtype, source: str, stream: bool = False, device: str = "cpu",
                 tokenizer: Path | None = None) -> LoadedModel:
    """`tokenizer`: the --tokenizer folder, else the model folder's own tokenizer (read first: a broken one is
    refused before the weights are read)."""
    config = read_config(folder)
    tok = load_tokenizer_folder(tokenizer) if tokenizer is not None else load_tokenizer(folder)
    shards = Shards(folder)  # refuses pickled weights, missing shards and unreadable headers up front
    cls = model_class_for(config)
    check_config(config, cls, shards, folder)  # before anything is built from it; refuses a weight the shards lack
    check_finite(shards, folder)
    if stream:
        streamed = load_streamed(folder, config, device, cls=cls, shards=shards)
        if streamed is not None:
            return LoadedModel(streamed, tok, source, folder, tokenizer)
    try:
        with quiet_transformers():
            model, info = from_pretrained(cls, folder, dtype=dtype, local_files_only=True, output_loading_info=True)
    except Exception as e:  # corrupt or truncated weights surface as many exception types
        raise HalfsafeError(
            f"could not load the weights in {folder} ({_first_line(e)}): the checkpoint looks corrupt; re-download or re-save it"
        ) from None
    check_loading_info(model, info, str(folder))  # a weight transformers filled in at random: refused
    model.eval()
    return LoadedModel(model.to(device) if device != "cpu" else model, tok, source, folder, tokenizer)


def load_streamed(folder: Path, config: PretrainedConfig, device: "str | torch.device", dtype: torch.dtype = torch.float32,
                  cls=None, shards=None) -> PreTrainedModel | None:
    """The folder's model with its weights left in the shards, each block loaded as it runs (halfsafe.engine),
    computing in `dtype` for its life; or None (logged) where transformers must convert the checkpoint's tensors on
    load. `cls` and `shards`: the model class and the folder's `Shards`, where the caller has them already."""
    from transformers import GenerationConfig

    # a folder without safetensors weights, or a config no class fits, is refused here, not logged and loaded whole
    cls = cls if cls is not None else model_class_for(config)
    shards = shards if shards is not None else Shards(folder)
    try:
        with quiet_transformers():
            streamed = build(config, cls, shards, str(device))
    except HalfsafeError as e:
        logging.getLogger(__name__).warning("%s; loading the whole model instead", e)
        return None
    if (folder / "generation_config.json").is_file():
        streamed.model.generation_config = from_pretrained(GenerationConfig, folder, local_files_only=True)
    if dtype != torch.float32:
        streamed.set_dtype(dtype)
    return streamed.model


def _load_cached_hub_id(repo_id: str, dtype: torch.dtype, stream: bool = False, device: str = "cpu",
                        tokenizer: Path | None = None) -> LoadedModel:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise HalfsafeError(
            f"{repo_id} is neither a local path nor in the local Hugging Face cache: download it first "
            f"(hf download {repo_id}) or give a folder"
        ) from None
    return _load_folder(folder, dtype, repo_id, stream, device, tokenizer)  # a cached hub snapshot, as a folder


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))
