"""The files beside the graphs in a transformers.js model folder: the source's side files copied, config.json and
tokenizer_config.json marked with what transformers.js reads from them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from .onnx_common import ONNX_FILE

log = logging.getLogger(__name__)

SKIP = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.gguf")


def copy_side_files(src: Path, dst: Path) -> None:
    """Config, generation config, tokenizer, halfsafe.json, card and legal text: everything but the weights."""
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in SKIP):
            shutil.copy2(f, dst / f.name)


def mark_config(folder: Path, external: bool | list[str], kv_cache: bool = True) -> None:
    """transformers.js reads its loading options from config.json: fp16 weights, an fp16 KV cache (3.x makes the
    empty cache in the dtype it names, float32 if none; `kv_cache`: the model has one), and which files keep their
    weights in an external data file (`external`: the .onnx file names, or True for `model_fp16.onnx`)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    js = {"dtype": "fp16", "kv_cache_dtype": {"fp16": "float16"}} if kv_cache else {"dtype": "fp16"}
    if external:
        js["use_external_data_format"] = {name: True for name in (external if isinstance(external, list) else [Path(ONNX_FILE).name])}
    config["transformers.js_config"] = js
    path.write_text(json.dumps(config, indent=2) + "\n")


def mark_tokenizer(folder: Path) -> None:
    """transformers.js's text-generation pipeline adds special tokens only when tokenizer_config.json says
    `add_bos_token` or `add_eos_token`; transformers adds what the tokenizer's post-processor adds (Gemma's <bos>).
    Write the flags the tokenizer's own behaviour implies, so the client encodes a prompt as transformers does."""
    path = folder / "tokenizer_config.json"
    if not path.is_file() or not (folder / "tokenizer.json").is_file():
        return
    from transformers import AutoTokenizer

    from ..io.loading import _first_line
    from ..io.trust import from_pretrained, quiet_transformers

    try:
        with quiet_transformers():
            tokenizer = from_pretrained(AutoTokenizer, folder, local_files_only=True)
    except Exception as e:  # a tokenizer transformers cannot load: nothing to match
        log.warning(f"tokenizer in {folder} not loaded ({type(e).__name__}: {_first_line(e)}): add_bos_token not written")
        return
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("Hello")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = json.loads(path.read_text())
    config["add_bos_token"] = bos is not None and full[:1] == [bos] and plain[:1] != [bos]
    config["add_eos_token"] = eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]
    path.write_text(json.dumps(config, indent=2) + "\n")
