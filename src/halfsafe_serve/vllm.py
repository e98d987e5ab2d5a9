"""halfsafe's vLLM plugin: vLLM runs a folder halfsafe made fp16-safe in float16, and refuses everything else as before.

vLLM refuses float16 for the model types in `vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS` (Gemma 2, Gemma 3,
GLM-4: "Numerical instability"), and with `--dtype auto` quietly casts their float16 config to bfloat16. vLLM calls
`register` in every process it starts (entry point group `vllm.general_plugins`, pyproject.toml), before any model
config is built. It wraps `_get_and_verify_dtype`, the one function that applies that table: for a model type in the
table, and a model that is a local folder (or a hub id already in the local cache: nothing is downloaded) whose
halfsafe.json says it is fp16-safe and whose weights are the ones that record fingerprinted, the table's entry for
that model type is lifted for that one call, so `--dtype float16` passes and `--dtype auto` keeps the config's
float16. Any other model goes through vLLM's function untouched; a folder with a halfsafe.json that does not
verify is refused as before, vLLM's error followed by why, naming `halfsafe apply`.

Where a vLLM release has moved what this needs, `register` logs one line and changes nothing.
"""

from __future__ import annotations

import inspect
import logging
import threading
from pathlib import Path

from .fingerprint import NotVerified, verified_record

# under vLLM's logger, so its handler and format apply
log = logging.getLogger("vllm.plugins.halfsafe")
_lock = threading.Lock()
_MARK = "_halfsafe_wrapped"


def register() -> None:
    """The `vllm.general_plugins` entry point. Never raises: vLLM does not catch a plugin's error."""
    try:
        _install()
    except Exception as e:  # noqa: BLE001 (any failure here must leave vLLM as it is)
        log.warning("halfsafe: vLLM plugin inactive, vLLM unchanged (%s: %s)", type(e).__name__, e)


def _install() -> None:
    from vllm.config import model as config_model

    table = getattr(config_model, "_FLOAT16_NOT_SUPPORTED_MODELS", None)
    original = getattr(config_model, "_get_and_verify_dtype", None)
    if getattr(original, _MARK, False):
        return  # registered already in this process
    params = list(inspect.signature(original).parameters) if callable(original) else []
    if not isinstance(table, dict) or params[:3] != ["model_id", "config", "dtype"] or "revision" not in params:
        log.warning("halfsafe: this vLLM's float16 check is not where halfsafe's plugin looks for it "
                    "(vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS, _get_and_verify_dtype); vLLM unchanged")
        return

    def _get_and_verify_dtype(model_id, config, dtype, *args, **kwargs):
        model_type = getattr(config, "model_type", None)
        if model_type not in table:  # every model vLLM runs in float16 anyway
            return original(model_id, config, dtype, *args, **kwargs)
        folder = local_folder(model_id, kwargs.get("revision"))
        if folder is None:
            return original(model_id, config, dtype, *args, **kwargs)
        try:
            verified_record(folder)
        except NotVerified as e:
            if getattr(e, "absent", False):  # not a folder halfsafe wrote: untouched, silently
                return original(model_id, config, dtype, *args, **kwargs)
            why = f"halfsafe: float16 not allowed for {model_id}: {e}"
            try:
                resolved = original(model_id, config, dtype, *args, **kwargs)
            except ValueError as refused:  # vLLM's refusal, and why halfsafe's record did not lift it
                raise ValueError(f"{refused} ({why})") from None
            log.warning(why)
            return resolved
        with _lock:  # the table's entry is lifted for this call only
            reason = table.pop(model_type)
            try:
                resolved = original(model_id, config, dtype, *args, **kwargs)
            finally:
                table[model_type] = reason
        log.info("halfsafe: %s is fp16-safe by its halfsafe.json (weights fingerprint checked): %s allowed for %s",
                 model_id, resolved, model_type)
        return resolved

    setattr(_get_and_verify_dtype, _MARK, True)
    _get_and_verify_dtype.__wrapped__ = original  # type: ignore[attr-defined]
    config_model._get_and_verify_dtype = _get_and_verify_dtype


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
