"""The model card: halfsafe's section of README.md, made from the saved record (io.report) and nothing else, so the
card says what halfsafe.json says. Appended to the card the source carried over (its own text stays first).

One section for every folder with a plan (convert, finetune, apply), and for a fine-tune that took steps a second
one saying the weights are no longer an exact rescaling. `halfsafe apply` measures none of convert's numbers (peak
before, fp32 change, fp16 check on calibration): its card shows them as nan and None.
"""

from __future__ import annotations

import math
from pathlib import Path

from .._version import __version__
from .report import Conversion, Finetuned, Record

FILE = "README.md"
TITLE = "## float16 conversion (halfsafe)"


def write(folder: Path, record: Record) -> None:
    """Append the record's sections to `folder`/README.md (made when the source had none)."""
    path = Path(folder) / FILE
    lines = _conversion(record)
    if record.finetuned is not None and record.finetuned.report.steps:
        lines += _finetune(record.finetuned)
    text = path.read_text() if path.exists() else ""
    path.write_text(text.rstrip() + "\n" + "\n".join(lines) + "\n")


def _conversion(record: Record) -> list[str]:
    plan, c = record.plan, record.conversion
    res = plan.exponents.get("residual")
    margin = c.margin if c is not None else None
    return [
        "",
        TITLE,
        "",
        f"Converted from `{record.source}` by halfsafe {__version__}: an exact, function-preserving",
        "power-of-two rescaling of the weights, so the model runs in float16 without inf/NaN. This is an",
        "ordinary float16 checkpoint: load it with plain transformers (`dtype=torch.float16`), no custom code.",
        "",
        f"- family: {plan.family}, model_type: {plan.model_type}",
        f"- residual-stream scale: 2^{res}" if res is not None else "- no residual-stream scale (per-norm scales)",
        f"- tensors rescaled: {len(plan.tensors)}; norm eps moved by 2^{plan.eps_exponent}"
        + "".join(f"; {k} by 2^{v}" for k, v in plan.eps_fields.items()),
        f"- margin: {plan.headroom_bits:.2f} bits under 65504, made for contexts up to {plan.context_length} tokens"
        + (f" ({margin.rule})" if margin else ""),
        f"- activation peak before: {_measured(c, 'peak_before'):.4g}",
        f"- check on calibration text: fp16 finite = {c.fp16_finite_on_calibration if c is not None else None}, "
        f"fp32 output change = {_measured(c, 'fp32_output_change'):.2e}",
        "",
        "`halfsafe.json` beside the weights lists every rescaled tensor with its exponent and the measurements.",
    ]


def _measured(c: Conversion | None, name: str) -> float:
    return getattr(c, name) if c is not None else math.nan


def _finetune(done: Finetuned) -> list[str]:
    report, fp16 = done.report, done.fp16_check
    return [
        "",
        "## float16 penalty fine-tune (halfsafe finetune)",
        "",
        "After the exact rescaling above, some activations no exact rescaling reaches were still above the",
        f"threshold ({report.threshold:g}); the model was fine-tuned for {report.steps} steps to bring them down while",
        "staying close to the original (KL distillation on the original's logits). These weights are therefore",
        f"*not* an exact rescaling: mean KL to the original {report.kl:.2e} nats/token on the fine-tune text.",
        "",
        f"- sites fine-tuned: {', '.join(report.watched[:6])}{' ...' if len(report.watched) > 6 else ''}",
        f"- stop: {report.stop_reason}",
        f"- largest |x| after (float32): {report.max_peak_after:.4g} at {report.max_site_after}",
        f"- float16 check: finite = {fp16['finite']}, largest |x| {fp16['peak']:.4g}",
    ]
