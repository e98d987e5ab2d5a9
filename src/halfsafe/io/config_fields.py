"""config.json's fields, checked before transformers reads the file: each a one-line refusal naming the file, the field
and the fix, where transformers would raise a traceback deep in a model's constructor or build a wrong model quietly.

Checked, at the top level and in every sub-config (text_config, vision_config, encoder ...): the sizes halfsafe and
transformers build the model from (a positive integer: not "2", 2.0, true or -1; transformers takes -1 layers and
builds a model with none, and divides by a head count of 0), the norm epsilons halfsafe rescales (a finite number
not below 0), the head tie halfsafe's families read (true or false: the string "no" is true to Python), the token
ids (an integer or null; a padding id outside the vocabulary fails in torch's embedding), `model_type` and
`architectures` (text). Whatever else transformers' own typed config refuses is caught where it reads the file
(`loading.read_config`), in one line too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import HalfsafeError

SIZES = frozenset((
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "head_dim", "max_position_embeddings", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
    "d_model", "d_ff", "d_kv", "num_layers", "num_decoder_layers", "num_heads", "n_embd", "n_layer", "n_head",
    "n_positions", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_ffn_dim", "decoder_ffn_dim",
))
MAY_BE_NULL = frozenset(("head_dim", "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "n_inner"))
EPSILONS = frozenset(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "layer_norm_eps_text"))
FLAGS = frozenset(("tie_word_embeddings",))
TOKEN_IDS = frozenset(("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"))
_DEPTH = 8  # sub-configs nest a few deep; a file nesting deeper holds no config halfsafe knows


def check_fields(config_file: Path, data) -> None:
    """`data`, config.json as parsed, is a JSON object whose checked fields (the module docstring) hold what they must."""
    if not isinstance(data, dict):
        raise HalfsafeError(f"{config_file} holds {_what(data)}, not a JSON object of settings: fix config.json or "
                            "re-download it")
    for name in ("model_type",):
        if name in data and not isinstance(data[name], str):
            raise _bad(config_file, name, data[name], "a model type name in quotes, e.g. \"llama\"")
    archs = data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise _bad(config_file, "architectures", archs, "a list of class names, e.g. [\"LlamaForCausalLM\"]")
    _check(config_file, data, "", 0)


def _check(config_file: Path, node: dict, where: str, depth: int) -> None:
    vocab = node.get("vocab_size")
    for key, value in node.items():
        name = f"{where}{key}"
        if key in SIZES and not (value is None and key in MAY_BE_NULL) and not _positive_int(value):
            raise _bad(config_file, name, value, "a positive whole number, without quotes (e.g. 2, not \"2\" or 2.0)")
        if key in EPSILONS and not _number(value, lambda v: math.isfinite(v) and v >= 0):
            raise _bad(config_file, name, value, "a finite number not below 0, without quotes (e.g. 1e-06)")
        if key in FLAGS and not isinstance(value, bool):
            raise _bad(config_file, name, value, "true or false, without quotes")
        if key in TOKEN_IDS:
            ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
            if not all(v is None or _int(v) for v in ids):
                raise _bad(config_file, name, value, "a token id (a whole number without quotes) or null")
            if key == "pad_token_id" and _int(value) and _positive_int(vocab) and not -vocab <= value < vocab:
                raise _bad(config_file, name, value, f"an id the vocabulary holds (0 .. {vocab - 1}) or null")
        if isinstance(value, dict) and depth < _DEPTH:
            _check(config_file, value, f"{name}.", depth + 1)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
    return _int(value) and value > 0


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
