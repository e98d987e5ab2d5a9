"""Reading one model from disk: the transformers class a config names, a GGUF file (dequantized by transformers),
a folder's tokenizer. `loading.load_model` chooses what to read from what the user named; the built-in fixture
(`builtin`) reads its GGUF here too, before any folder of it exists.
"""

from __future__ import annotations

import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ..engine.device import return_freed_memory
from ..errors import HalfsafeError, UnsupportedModelError
from .trust import check_folder, from_pretrained, inside, quiet_transformers
from .validate import check_finite_parameters, check_loading_info

_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModelForImageTextToText",
                 "AutoModel")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object | None  # None: the checkpoint ships no tokenizer; text is fed as byte ids
    source: str  # what the user named
    folder: Path | None  # a Hugging Face folder holding config (and tokenizer) files, if any
    tokenizer_folder: Path | None = None  # the folder the tokenizer came from, where not `folder` (--tokenizer)

    def set_tokenizer_aside(self):
        """Drop the tokenizer until it is needed again (to save it beside the converted weights): Gemma 3's
        262k-entry tokenizer holds 0.33 GB, a third of what converting the model needs. Returns what gives it
        back: the tokenizer reloaded from the folder (or the same object, where there is no folder to reload from)."""
        folder = self.tokenizer_folder or self.folder
        if folder is None or self.tokenizer is None:
            kept = self.tokenizer
            return lambda: kept
        self.tokenizer = None
        return_freed_memory()

        def reload():
            return_freed_memory()  # what the work in between freed, before the tokenizer's load peak
            return load_tokenizer(folder)

        return reload


def model_class_for(config: PretrainedConfig):
    """The transformers class named in the config's `architectures`, else the first auto class that fits."""
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto_name in _AUTO_CLASSES:
        auto = getattr(transformers, auto_name)
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise UnsupportedModelError(f"transformers has no model class for model_type {config.model_type!r}")


def load_gguf(path: Path, dtype: torch.dtype, source: str, device: str = "cpu", tokenizer: Path | None = None) -> LoadedModel:
    """The model in a GGUF file, dequantized by transformers, in `dtype` on `device`, with the tokenizer the file holds
    (or the one in the folder `tokenizer`, checked as a model folder is). Only the file is read: transformers sees it
    alone in a private folder, never its neighbours. Its layer count is checked against its tensors before any model is
    built, and a weight the file lacks is refused (transformers would fill it in at random)."""
    metadata = check_gguf_header(path)
    with _alone(path) as (folder, name):
        try:
            with quiet_transformers():
                config = from_pretrained(AutoConfig, folder, gguf_file=name)
        except ImportError as e:
            raise HalfsafeError(f"reading GGUF needs the gguf package: pip install gguf ({_first_line(e)})") from None
        except Exception as e:
            raise HalfsafeError(f"could not read the GGUF file {path} ({_first_line(e)}): check that it is complete") from None
        tok = load_tokenizer_folder(tokenizer) if tokenizer is not None else _gguf_tokenizer(path, folder, name, metadata)
        try:
            with quiet_transformers(), _no_tensor_bar():
                model, info = from_pretrained(model_class_for(config), folder, gguf_file=name, dtype=dtype,
                                              output_loading_info=True)
        except Exception as e:
            raise HalfsafeError(f"could not read the GGUF file {path} ({_first_line(e)}): check that it is complete") from None
    check_loading_info(model, info, str(path))  # a weight transformers filled in at random: refused
    _forget_gguf_quantization(model)
    model.eval()
    check_finite_parameters(model, source)
    return LoadedModel(model.to(device) if device != "cpu" else model, tok, source, None, tokenizer)


def check_gguf_header(path: Path) -> dict:
    """The file's layer count (`<arch>.block_count`) against the layers its tensors hold, from the header alone (no
    tensor is read, no model built): a file claiming 100000 layers is refused in a moment, as is one lacking a layer.
    Returns the header's metadata."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, names = read_gguf_metadata(str(path))
    except ImportError as e:
        raise HalfsafeError(f"reading GGUF needs the gguf package: pip install gguf ({_first_line(e)})") from None
    except Exception as e:
        raise HalfsafeError(f"could not read the GGUF file {path} ({_first_line(e)}): check that it is complete") from None
    arch = metadata.get("general.architecture")
    blocks = metadata.get(f"{arch}.block_count")
    if blocks is None:
        return metadata
    held = {int(m.group(1)) for n in names if (m := _GGUF_LAYER.match(n))}
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1 or len(held) != blocks or held != set(range(blocks)):
        absent = sorted(set(range(blocks)) - held) if isinstance(blocks, int) and blocks <= len(names) else []
        holds = f"layers 0 .. {max(held)}" if held else "no layer"
        lacks = f" (none of blk.{absent[0]}'s)" if absent else ""
        raise HalfsafeError(f"{path} claims {blocks} layers ({arch}.block_count) but its tensors hold {holds}{lacks}: "
                            "the file is incomplete or its metadata wrong; re-download or re-convert it")
    return metadata


_GGUF_LAYER = re.compile(r"blk\.(\d+)\.")
_GGUF_TOKENIZER = "tokenizer.ggml.model"  # a GGUF that holds a tokenizer names its kind here


@contextmanager
def _alone(path: Path):
    """A private temporary folder holding only a link to the GGUF file: (folder, the link's absolute path, as
    transformers' `gguf_file`). transformers looks for config and tokenizer files beside the file it is given; here
    there are none, so nothing from the folder around the GGUF is ever read."""
    with tempfile.TemporaryDirectory(prefix="halfsafe-gguf-") as tmp:
        link = Path(tmp) / "model.gguf"
        link.symlink_to(Path(path).resolve())
        yield Path(tmp), str(link)


@contextmanager
def _no_tensor_bar():
    """transformers' GGUF reader draws its own tqdm bar (on stderr, past `quiet_transformers`): off for the duration,
    so that a refusal stays one line."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    saved = gguf_utils.tqdm
    gguf_utils.tqdm = lambda items, *args, **kwargs: items
    try:
        yield
    finally:
        gguf_utils.tqdm = saved


def _gguf_tokenizer(path: Path, folder: Path, name: str, metadata: dict):
    """The tokenizer the GGUF file holds (its header's `metadata` says whether it holds one), None where it holds none
    (text is then fed as byte ids); refused where it holds one that does not load."""
    if _GGUF_TOKENIZER not in metadata:
        return None
    try:
        with quiet_transformers():
            return from_pretrained(AutoTokenizer, folder, gguf_file=name)
    except Exception as e:
        raise HalfsafeError(f"could not read the tokenizer in the GGUF file {path} ({_first_line(e)}): re-convert the "
                            "file, or pass --tokenizer FOLDER with the model's own tokenizer") from None


def _forget_gguf_quantization(model: PreTrainedModel) -> None:
    """GGUF weights arrive dequantized; drop the marker so the model saves as an ordinary checkpoint."""
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None where it ships none (text is then fed as byte ids). A folder that ships
    tokenizer files that do not load is refused: its converted copy would lack the tokenizer it promises."""
    files = [f for f in TOKENIZER_FILES if (Path(folder) / f).exists() or (Path(folder) / f).is_symlink()]
    if not files:
        return None
    for f in files:
        inside(folder, f)  # a tokenizer file linking outside the folder is refused before it is opened
    try:
        with quiet_transformers():
            return from_pretrained(AutoTokenizer, folder, local_files_only=True)
    except Exception as e:
        raise HalfsafeError(f"could not read the tokenizer in {folder} ({', '.join(files)}: {_first_line(e)}): repair or "
                            "re-download those files, or pass --tokenizer FOLDER with the model's own tokenizer") from None


def load_tokenizer_folder(folder: str | Path):
    """The tokenizer in the folder the user named with --tokenizer, checked as a model folder is (every file inside
    it, no code of its own), and required: a folder without tokenizer files is refused."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise HalfsafeError(f"--tokenizer {folder}: no such folder; give the folder that holds the model's tokenizer files")
    check_folder(folder)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise HalfsafeError(f"--tokenizer {folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}): give the folder "
                            "that holds the model's tokenizer")
    return tokenizer


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
