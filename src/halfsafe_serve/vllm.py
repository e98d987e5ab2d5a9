"""halfsafe's vLLM plugin: vLLM runs a folder halfsafe made fp16-safe in float16, and refuses everything else as before.

vLLM refuses float16 for the model types in `vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS` (Gemma 2, Gemma 3,
GLM-4: "Numerical instability"), and with `--dtype auto` quietly casts their float16 config to bfloat16. vLLM calls
`register` in every process it starts (entry point group `vllm.general_plugins`, pyproject.toml), before any model
config is built. It wraps `_get_and_verify_dtype`, the one function that applies that table. For a model type in the
table, float16 is allowed when all of these hold: the model is a local folder (or a hub id already in the local cache:
nothing is downloaded); its halfsafe.json says it is fp16-safe and its config.json and weights are the ones that record
fingerprinted (halfsafe_serve.verified: hashed once, then known by file identity); and the config vLLM will run (the
object it passes, built from `--hf-config-path` and `--hf-overrides` when given) equals a config built by vLLM's own
reader from that fingerprinted config.json, in every field but the few in IGNORED. Then the table's entry for that
model type is lifted for that one call, so `--dtype float16` passes and `--dtype auto` keeps the config's float16.
Any other model goes through vLLM's function untouched; a folder with a halfsafe.json that does not verify, or run
with a config that differs (the original's rms_norm_eps over the rescaled one: a silently wrong model), is refused as
before, vLLM's error followed by why (the differing fields and both values, or `halfsafe apply`).

The table is lifted under one lock that every call for a model type in it takes, verified or not: no other call sees
the entry lifted. Where a vLLM release has moved what this needs, `register` logs one line and changes nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from pathlib import Path

from .fingerprint import NotVerified
from .verified import file_identity, verified

# under vLLM's logger, so its handler and format apply
log = logging.getLogger("vllm.plugins.halfsafe")
_lock = threading.Lock()  # held while the table's entry is lifted, and by every call for a model type in the table
_MARK = "_halfsafe_wrapped"
# the config fields that cannot change what the model computes: where the config was read from, the transformers
# version that wrote it, and the dtype fields (vLLM runs in the dtype its own --dtype resolves, which the table checks)
IGNORED = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype"})
_SHOWN = 4  # differing fields named in the refusal


def register() -> None:
    """The `vllm.general_plugins` entry point. Never raises: vLLM does not catch a plugin's error."""
    try:
        _install()
    except Exception as e:  # noqa: BLE001 (any failure here must leave vLLM as it is)
        log.warning("halfsafe: vLLM plugin inactive, vLLM unchanged (%s: %s)", type(e).__name__, e)


def _install() -> None:
    from vllm.config import model as config_model
    from vllm.transformers_utils import config as hf_configs

    table = getattr(config_model, "_FLOAT16_NOT_SUPPORTED_MODELS", None)
    original = getattr(config_model, "_get_and_verify_dtype", None)
    get_config = getattr(hf_configs, "get_config", None)
    if getattr(original, _MARK, False):
        return  # registered already in this process
    params = list(inspect.signature(original).parameters) if callable(original) else []
    reader = list(inspect.signature(get_config).parameters) if callable(get_config) else []
    if (not isinstance(table, dict) or params[:3] != ["model_id", "config", "dtype"] or "revision" not in params
            or reader[:2] != ["model", "trust_remote_code"] or "config_format" not in reader):
        log.warning("halfsafe: this vLLM's float16 check is not where halfsafe's plugin looks for it "
                    "(vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS, _get_and_verify_dtype, "
                    "vllm.transformers_utils.config.get_config); vLLM unchanged")
        return

    def _get_and_verify_dtype(model_id, config, dtype, *args, **kwargs):
        model_type = getattr(config, "model_type", None)
        with _lock:  # entries are lifted only under this lock: here the table is whole
            listed = model_type in table
        if not listed:  # every model vLLM runs in float16 anyway (its entry is never lifted)
            return original(model_id, config, dtype, *args, **kwargs)
        why = _why_not(model_id, config, kwargs.get("revision"), get_config)
        with _lock:
            if why is None:  # the table's entry is lifted for this call only
                reason = table.pop(model_type)
                try:
                    resolved = original(model_id, config, dtype, *args, **kwargs)
                finally:
                    table[model_type] = reason
            else:
                try:
                    resolved = original(model_id, config, dtype, *args, **kwargs)
                except ValueError as refused:  # vLLM's refusal, and why halfsafe's record did not lift it
                    if why:
                        raise ValueError(f"{refused} ({why})") from None
                    raise
        if why is None:
            log.info("halfsafe: %s is fp16-safe by its halfsafe.json (weights fingerprint checked, the config vLLM runs "
                     "is the one fingerprinted): %s allowed for %s", model_id, resolved, model_type)
        elif why:
            log.warning(why)
        return resolved

    setattr(_get_and_verify_dtype, _MARK, True)
    _get_and_verify_dtype.__wrapped__ = original  # type: ignore[attr-defined]
    config_model._get_and_verify_dtype = _get_and_verify_dtype


def _why_not(model_id, config, revision, get_config) -> str | None:
    """None: float16 allowed; "": not a folder halfsafe wrote (vLLM decides alone, silently); else why not (one line)."""
    folder = local_folder(model_id, revision)
    if folder is None:
        return ""
    try:
        before = _config_identity(folder)
    except OSError:
        before = None  # no config.json: the fingerprint's check, or the comparison, says so
    try:
        verified(folder)
    except NotVerified as e:
        return "" if getattr(e, "absent", False) else f"halfsafe: float16 not allowed for {model_id}: {e}"
    try:
        built = get_config(str(folder), False, config_format="hf")
        if built is config:  # a reader that hands back the object it made before compares nothing
            raise TypeError("vLLM's config reader returned the config vLLM runs, not one read from config.json")
        reference, ours = built.to_dict(), config.to_dict()
        same_file = _config_identity(folder) == before  # the config.json read is the one just verified
    except Exception as e:  # noqa: BLE001 (a config that cannot be compared is not allowed)
        return (f"halfsafe: float16 not allowed for {model_id}: its config could not be compared with "
                f"{folder}/config.json ({type(e).__name__}: {e})")
    if not same_file:
        return f"halfsafe: float16 not allowed for {model_id}: {folder}/config.json changed while it was checked"
    fields = differences(ours, reference)
    if not fields:
        return None
    shown = "; ".join(f"{k} {_short(a)} (the config vLLM runs) != {_short(b)} (config.json)" for k, a, b in fields[:_SHOWN])
    more = f"; and {len(fields) - _SHOWN} more" if len(fields) > _SHOWN else ""
    return (f"halfsafe: float16 not allowed for {model_id}: the config vLLM runs is not the config.json halfsafe.json "
            f"fingerprinted ({shown}{more}); the rescaled weights hold only with that config: drop --hf-overrides / "
            f"--hf-config-path, or convert the config you mean to run")


def differences(ours: dict, reference: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted field, our value, the reference's) for every field that differs, sub-configs field by field, IGNORED
    fields at any depth left out; a field only one side has differs ("<absent>" on the other)."""
    out = []
    for key in sorted(set(ours) | set(reference), key=str):
        if key in IGNORED:
            continue
        a, b = ours.get(key, "<absent>"), reference.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif type(a) is not type(b) or a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _config_identity(folder: Path) -> tuple:
    return file_identity(os.stat(folder / "config.json"))


def local_folder(model_id, revision: str | None = None) -> Path | None:
    """The folder `model_id` names on this machine: a local folder, or a hub id's snapshot in the local cache holding
    a halfsafe.json (never downloaded: vLLM fetches the weights later, so a model not yet fully in the cache is
    treated as not halfsafe's). None: neither."""
    try:
        path = Path(str(model_id)).expanduser()
        if path.is_dir():
            return path
        if str(model_id).count("/") != 1:
            return None
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(model_id), "halfsafe.json", revision=revision)
        return Path(found).parent if isinstance(found, str) else None
    except Exception:  # noqa: BLE001 (a hub id this cannot read is left to vLLM)
        return None
