"""Reading one model from disk: the transformers class a config names, a GGUF file (dequantized by transformers),
a folder's tokenizer. `loading.load_model` chooses what to read from what the user named; the built-in fixture
(`builtin`) reads its GGUF here too, before any folder of it exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ..engine.device import return_freed_memory
from ..errors import HalfsafeError, UnsupportedModelError
from .trust import from_pretrained, quiet_transformers
from .validate import check_finite_parameters

_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModelForImageTextToText",
                 "AutoModel")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object | None  # None: the checkpoint ships no tokenizer; text is fed as byte ids
    source: str  # what the user named
    folder: Path | None  # a Hugging Face folder holding config (and tokenizer) files, if any

    def set_tokenizer_aside(self):
        """Drop the tokenizer until it is needed again (to save it beside the converted weights): Gemma 3's
        262k-entry tokenizer holds 0.33 GB, a third of what converting the model needs. Returns what gives it
        back: the tokenizer reloaded from the folder (or the same object, where there is no folder to reload from)."""
        if self.folder is None or self.tokenizer is None:
            kept = self.tokenizer
            return lambda: kept
        folder, self.tokenizer = self.folder, None
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


def load_gguf(path: Path, dtype: torch.dtype, source: str, device: str = "cpu") -> LoadedModel:
    """The model in a GGUF file, dequantized by transformers, in `dtype` on `device`, with the tokenizer the file holds."""
    try:
        with quiet_transformers():
            config = from_pretrained(AutoConfig, path.parent, gguf_file=path.name)
            model = from_pretrained(model_class_for(config), path.parent, gguf_file=path.name, dtype=dtype)
    except ImportError as e:
        raise HalfsafeError(f"reading GGUF needs the gguf package: pip install gguf ({_first_line(e)})") from None
    except Exception as e:
        raise HalfsafeError(f"could not read the GGUF file {path} ({_first_line(e)}): check that it is complete") from None
    _forget_gguf_quantization(model)
    model.eval()
    check_finite_parameters(model, source)
    try:
        tokenizer = from_pretrained(AutoTokenizer, path.parent, gguf_file=path.name)
    except Exception:
        tokenizer = None
    return LoadedModel(model.to(device) if device != "cpu" else model, tokenizer, source, None)


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


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None where it ships none (text is then fed as byte ids) or it does not load."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")):
        return None
    try:
        with quiet_transformers():
            return from_pretrained(AutoTokenizer, folder, local_files_only=True)
    except Exception:
        logging.getLogger(__name__).warning("could not load the tokenizer in %s; feeding text as byte ids", folder)
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
