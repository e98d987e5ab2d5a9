"""Write the converted model as an ordinary fp16 Hugging Face checkpoint, atomically.

The folder is built under a temporary name beside OUT and renamed at the end, so an interrupted run
leaves no half-written OUT. Beside the weights: halfsafe.json (the plan and what was checked) and a
model card section.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from . import __version__
from .errors import HalfsafeError

_CARRY_OVER = ("LICENSE*", "NOTICE*", "USE_POLICY*", "*TERMS*", "*.md")  # legal text of the source travels with it


@contextmanager
def atomic_folder(out: Path):
    """Yield a temporary folder beside `out`; when the block succeeds it replaces `out`, when it fails
    it is removed. Either way no half-written `out` is ever visible."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint folder is ordinary
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_out_dir(out: str | Path, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and not overwrite:
        raise HalfsafeError(f"{out} already exists: choose another output folder or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise HalfsafeError(f"{out} exists and is not a folder: choose another output path")
    return out


def _check_weights(model: PreTrainedModel) -> None:
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise HalfsafeError(f"refusing to save: non-finite weights in {', '.join(bad[:3])} (please report this)")


def save_fp16_checkpoint(
    model: PreTrainedModel, tokenizer, out: str | Path, info: dict, source_folder: Path | None = None, overwrite: bool = False
) -> Path:
    """Cast `model` to fp16 in place and save it with its tokenizer, `info` as halfsafe.json and a card."""
    out = check_out_dir(out, overwrite)
    model.half()
    _check_weights(model)
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if source_folder is not None:
            for pattern in _CARRY_OVER:
                for f in source_folder.glob(pattern):
                    if f.is_file() and not (tmp / f.name).exists():
                        shutil.copy2(f, tmp / f.name)
        info = {"halfsafe_version": __version__, "transformers_version": transformers.__version__, "torch_version": torch.__version__, **info}
        (tmp / "halfsafe.json").write_text(json.dumps(info, indent=2, allow_nan=True) + "\n")
        _write_card(tmp / "README.md", info)
    return out


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
        f"- tensors rescaled: {len(plan.get('tensors', []))}; norm eps moved by 2^{plan.get('eps_exponent', 0)}",
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
