"""Write the converted model as an ordinary fp16 Hugging Face checkpoint, atomically.

The folder is built under a temporary name beside OUT and renamed at the end, so an interrupted run
leaves no half-written OUT. Beside the weights: halfsafe.json (the plan and what was checked) and a
model card section.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from transformers import PreTrainedModel

from . import __version__
from .engine.streamed import streamed_of
from .engine.write import DEFAULT_MAX_SHARD_SIZE, write_weights
from .errors import HalfsafeError
from .precision import cast_copy

log = logging.getLogger(__name__)
_CARRY_OVER = ("LICENSE*", "NOTICE*", "USE_POLICY*", "*TERMS*", "*.md")  # legal text of the source travels with it


_PID_FILE = ".halfsafe-pid"  # inside a temporary folder: the process writing it, so a later run knows it died


@contextmanager
def atomic_folder(out: Path):
    """Yield a temporary folder beside `out`; when the block succeeds it replaces `out`, when it fails it is
    removed. An existing `out` is renamed aside first and deleted only once the new one is in place, so a
    crash at any moment leaves either the old or the new folder, never a half-written one."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    (tmp / _PID_FILE).write_text(str(os.getpid()))
    old = None
    try:
        yield tmp
        (tmp / _PID_FILE).unlink()
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint folder is ordinary
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            (old / _PID_FILE).write_text(str(os.getpid()))
            out.rename(old / out.name)
        try:
            tmp.rename(out)
        except OSError:
            if old is not None:  # put the old folder back
                (old / out.name).rename(out)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> list[Path]:
    """Remove what a killed run left beside `out` (`.OUT.tmp-*`, `.OUT.old-*` whose process is gone), saying so;
    an `.OUT.old-*` still holding a complete folder while `out` is missing is moved back first."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for leftover in sorted(out.parent.glob(f".{out.name}.tmp-*")) + sorted(out.parent.glob(f".{out.name}.old-*")):
        try:
            pid = int((leftover / _PID_FILE).read_text())
        except (OSError, ValueError):
            pid = None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue  # another run is writing it now
        kept = leftover / out.name
        if leftover.name.startswith(f".{out.name}.old-") and kept.is_dir() and not out.exists():
            kept.rename(out)  # killed between renaming the old folder aside and the new one in
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
        log.warning("removed %s, left by a halfsafe run that did not finish", leftover)
    return removed


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_out_dir(out: str | Path, overwrite: bool, needed_bytes: int = 0) -> Path:
    """Fail now, not after an hour of work: OUT must not exist (unless overwrite), its folder must be creatable and
    writable, and the disk must hold `needed_bytes` more (the existing OUT too, which stays until the new one is done)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise HalfsafeError(f"{out} already exists: choose another output folder or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise HalfsafeError(f"{out} exists and is not a folder: choose another output path")
    base = _existing_ancestor(out.parent)
    if not base.is_dir():
        raise HalfsafeError(f"cannot create {out}: {base} is not a folder; choose another output path")
    try:  # os.access says yes to root on a read-only mount: try for real
        probe = Path(tempfile.mkdtemp(prefix=".halfsafe-write-test-", dir=base))
        probe.rmdir()
    except OSError as e:
        raise HalfsafeError(f"cannot write to {base} ({e.strerror}): choose a writable output folder") from None
    if needed_bytes:
        free = shutil.disk_usage(base).free
        if free < needed_bytes:
            raise HalfsafeError(
                f"{base} has {free / 1e9:.2f} GB free, the output needs about {needed_bytes / 1e9:.2f} GB: "
                "free some space or choose another output folder"
            )
    return out


def output_bytes(model: PreTrainedModel) -> int:
    """The float16 checkpoint's size: 2 bytes per distinct parameter, plus room for tokenizer and metadata."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return 2 * sum(seen.values()) + (64 << 20)


def _check_weights(model: PreTrainedModel) -> None:
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise HalfsafeError(f"refusing to save: non-finite weights in {', '.join(bad[:3])} (please report this)")


def save_fp16_checkpoint(
    model: PreTrainedModel, tokenizer, out: str | Path, info: dict, source_folder: Path | None = None, overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, progress: bool = False,
) -> Path:
    """Save `model` as float16 (the caller's model is left as it is) with its tokenizer, `info` as halfsafe.json and a
    card. A streamed model is written tensor by tensor from its shards."""
    out = check_out_dir(out, overwrite, output_bytes(model))
    try:
        with atomic_folder(out) as tmp:
            if streamed_of(model) is not None:
                _write_streamed(model, tmp, max_shard_size, progress)
            else:
                half = cast_copy(model, torch.float16)
                _check_weights(half)
                half.save_pretrained(tmp, max_shard_size=max_shard_size)
                del half
            _write_extras(tokenizer, tmp, info, source_folder)
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise HalfsafeError(f"could not write {out}: {reason}; nothing was left behind. Free some space or choose "
                            "another output folder") from None
    return out


def _write_streamed(model: PreTrainedModel, tmp: Path, max_shard_size, progress: bool) -> None:
    bad = write_weights(streamed_of(model), tmp, max_shard_size, progress)
    if bad:
        raise HalfsafeError(f"refusing to save: non-finite weights in {', '.join(bad[:3])} (please report this)")
    dtype, architectures = model.config.dtype, model.config.architectures
    model.config.dtype, model.config.architectures = "float16", [type(model).__name__]  # as save_pretrained records them
    try:
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
    finally:
        model.config.dtype, model.config.architectures = dtype, architectures


def _write_extras(tokenizer, tmp: Path, info: dict, source_folder: Path | None) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if source_folder is not None:
        for pattern in _CARRY_OVER:
            for f in source_folder.glob(pattern):
                if f.is_file() and not (tmp / f.name).exists():
                    shutil.copy2(f, tmp / f.name)
    info = {"halfsafe_version": __version__, "transformers_version": transformers.__version__, "torch_version": torch.__version__, **info}
    (tmp / "halfsafe.json").write_text(json.dumps(info, indent=2, allow_nan=True) + "\n")
    if "plan" in info:
        _write_card(tmp / "README.md", info)


def _write_card(path: Path, info: dict) -> None:
    plan = info.get("plan", {})
    res = plan.get("exponents", {}).get("residual")
    lines = [
        "",
        "## float16 conversion (halfsafe)",
        "",
        f"Converted from `{info.get('source', '?')}` by halfsafe {__version__}: an exact, function-preserving",
        "power-of-two rescaling of the weights, so the model runs in float16 without inf/NaN. This is an",
        "ordinary float16 checkpoint: load it with plain transformers (`dtype=torch.float16`), no custom code.",
        "",
        f"- family: {plan.get('family')}, model_type: {plan.get('model_type')}",
        f"- residual-stream scale: 2^{res}" if res is not None else "- no residual-stream scale (per-norm scales)",
        f"- tensors rescaled: {len(plan.get('tensors', []))}; norm eps moved by 2^{plan.get('eps_exponent', 0)}"
        + "".join(f"; {k} by 2^{v}" for k, v in plan.get("eps_fields", {}).items()),
        f"- margin: {plan.get('headroom_bits'):.2f} bits under 65504, made for contexts up to {plan.get('context_length')} tokens"
        + (f" ({info['margin']['rule']})" if info.get("margin") else ""),
        f"- activation peak before: {info.get('peak_before', float('nan')):.4g}",
        f"- check on calibration text: fp16 finite = {info.get('fp16_finite_on_calibration')}, "
        f"fp32 output change = {info.get('fp32_output_change', float('nan')):.2e}",
        "",
        "`halfsafe.json` beside the weights lists every rescaled tensor with its exponent and the measurements.",
    ]
    text = path.read_text() if path.exists() else ""
    path.write_text(text.rstrip() + "\n" + "\n".join(lines) + "\n")
