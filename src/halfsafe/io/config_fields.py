"""config.json's fields, checked before transformers reads the file: each a one-line refusal naming the file, the field
and the fix, where transformers would take the value and then raise a traceback deep in a model's constructor, or
build a wrong model quietly (it takes -1 layers and builds a model with none; it divides by a head count of 0).

Checked, at the top level and in `text_config` (the config halfsafe reads through `get_text_config()`): the sizes the
model is built from, where they are integers, at least 1 (a list or null is the config class's to accept: Swin's
per-stage head counts, a vision config's null vocabulary); the norm epsilons halfsafe rescales (a finite number not
below 0); the head tie halfsafe's families read (true or false: the string "no" is true to Python); `model_type` and
`architectures` (text). The type of every other field (a quoted number, a float where an integer is needed) is
transformers' typed config's to refuse, which `loading.read_config` turns into one line naming the field; a config
no model can be built from is refused where the model's skeleton is built (`validate.check_config`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import HalfsafeError

SIZES = frozenset((
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "max_position_embeddings", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok", "d_model", "d_ff",
    "d_kv", "num_layers", "num_decoder_layers", "num_heads", "n_embd", "n_layer", "n_head", "n_positions",
))
EPSILONS = frozenset(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"))
FLAGS = frozenset(("tie_word_embeddings",))
TEXT = "text_config"  # the sub-config halfsafe reads as the language model's


def check_fields(config_file: Path, data) -> None:
    """`data`, config.json as parsed, is a JSON object whose checked fields (the module docstring) hold what they must."""
    if not isinstance(data, dict):
        raise HalfsafeError(f"{config_file} holds {_what(data)}, not a JSON object of settings: fix config.json or "
                            "re-download it")
    if "model_type" in data and not isinstance(data["model_type"], str):
        raise _bad(config_file, "model_type", data["model_type"], "a model type name in quotes, e.g. \"llama\"")
    archs = data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise _bad(config_file, "architectures", archs, "a list of class names, e.g. [\"LlamaForCausalLM\"]")
    _check(config_file, data, "")
    if isinstance(data.get(TEXT), dict):
        _check(config_file, data[TEXT], f"{TEXT}.")


def _check(config_file: Path, node: dict, where: str) -> None:
    for key, value in node.items():
        name = f"{where}{key}"
        if key in SIZES and (isinstance(value, bool) or (_int(value) and value < 1)):
            raise _bad(config_file, name, value, "a positive whole number, without quotes (e.g. 2)")
        if key in EPSILONS and value is not None and not _number(value, lambda v: math.isfinite(v) and v >= 0):
            raise _bad(config_file, name, value, "a finite number not below 0, without quotes (e.g. 1e-06)")
        if key in FLAGS and value is not None and not isinstance(value, bool):
            raise _bad(config_file, name, value, "true or false, without quotes")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value, ok) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and ok(float(value))
    except OverflowError:  # an integer past float's range
        return False


def _what(value) -> str:
    """A JSON value's kind, in words."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _bad(config_file: Path, field: str, value, want: str) -> HalfsafeError:
    shown = _what(value) if isinstance(value, (dict, list)) else f"{json.dumps(value)[:60]} ({_what(value)})"
    return HalfsafeError(f"{config_file}: {field} is {shown}, but must be {want}: fix that field in config.json or "
                         "re-download it")
