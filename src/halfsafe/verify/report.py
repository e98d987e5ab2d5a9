"""What `verify` found, per variant and per text: the dataclasses, their JSON form, a markdown table, and the
machine the numbers come from (they depend on it: CPU and GPU kernels round differently)."""

from __future__ import annotations

import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from .._version import __version__
from ..core.collapse import is_collapsed
from ..core.formats import FP16_MAX
from .variants import REFERENCE, Variant


@dataclass
class Metrics:
    """Fidelity of one variant on some tokens (one text, or all of them)."""

    positions: int = 0  # logit rows compared
    nonfinite_logits: int = 0
    nonfinite_positions: int = 0  # rows with any inf/NaN
    kl_mean: float = 0.0  # mean KL(fp32 || variant) per position, nats (NaN if any row is non-finite)
    top1: float = 0.0  # fraction of positions whose argmax matches fp32's
    perplexity: float | None = None  # exp(mean next-token NLL) of the text under this variant (None: not an LM)
    max_abs_logit_error: float = 0.0  # max |logit - fp32 logit| (NaN/inf if any logit is non-finite)
    greedy_matched: int | None = None  # generated tokens equal to fp32's before the first difference, summed
    greedy_total: int | None = None  # tokens generated (per prompt x prompts)
    # collapse (verify --runtime): outputs that are finite and still broken; None where not measured
    entropy_mean: float | None = None  # mean entropy of the variant's next-token distribution, nats
    uniform_positions: int | None = None  # finite rows nearly uniform (core.collapse.UNIFORM) where fp32's are not
    mode_fraction: float | None = None  # share of positions whose top-1 is the variant's most frequent top-1

    @property
    def greedy_fraction(self) -> float | None:
        return self.greedy_matched / self.greedy_total if self.greedy_total else None

    @property
    def collapsed(self) -> bool | None:
        """Finite but broken: most rows nearly uniform, or one token on top nearly everywhere while fp32 disagrees."""
        if self.uniform_positions is None:
            return None
        return is_collapsed(self.positions, self.uniform_positions, self.mode_fraction, self.top1)

    def to_dict(self) -> dict:
        d = {**asdict(self), "greedy_fraction": self.greedy_fraction}
        if self.uniform_positions is None:
            for k in ("entropy_mean", "uniform_positions", "mode_fraction"):
                d.pop(k)
        else:
            d["collapsed"] = self.collapsed
        return d


@dataclass
class VariantResult:
    variant: Variant
    overall: Metrics
    per_text: list[Metrics]
    parameter_bytes: int
    peak_activation_bytes: int  # tensors live at once during one forward pass (first sample), beyond the weights
    memory_method: str
    layer_peaks: list[float]  # residual |x| max after each block (inf where non-finite), over all samples
    # per text: the reference's generated tokens; a variant's up to and including the first that differs from the
    # reference's (verify.forced: what its generation picks after the reference's tokens), all where none differs
    greedy_tokens: list[list[int]]
    forward_seconds: float  # all forward passes, a variant's teacher-forced greedy forward included (not generation)
    forward_tokens: int

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def forward_tokens_per_s(self) -> float:
        return self.forward_tokens / self.forward_seconds if self.forward_seconds > 0 else math.nan

    def to_dict(self) -> dict:
        return {
            **self.variant.to_dict(),
            "overall": self.overall.to_dict(),
            "per_text": [m.to_dict() for m in self.per_text],
            "parameter_bytes": self.parameter_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "memory_method": self.memory_method,
            "layer_peaks": self.layer_peaks,
            "greedy_tokens": self.greedy_tokens,
            "forward_seconds": self.forward_seconds,
            "forward_tokens_per_s": self.forward_tokens_per_s,
        }


@dataclass
class VerifyReport:
    model: str
    converted: str | None
    model_type: str
    texts: list[dict]  # name, samples, tokens
    seq_len: int
    greedy_tokens: int
    prompt_tokens: int
    layers: list[str]
    results: list[VariantResult]
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why
    environment: dict = field(default_factory=dict)
    runtime: dict | None = None  # the runtime profile the "@ profile" variants emulate (verify --runtime)
    phases: list[dict] = field(default_factory=list)  # {"name", "wall_s", "cpu_s"} per phase (halfsafe.progress)
    checkpoint_reads: dict = field(default_factory=dict)  # passes over the checkpoints per phase (engine.reads)
    fp16_arith: dict | None = None  # how the float16 variants computed (halfsafe.engine.fp16_arith.resolve)

    def result(self, name: str) -> VariantResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no variant {name!r} in this report (have: {', '.join(r.name for r in self.results)})")

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "converted": self.converted,
            "model_type": self.model_type,
            "texts": self.texts,
            "seq_len": self.seq_len,
            "greedy_tokens": self.greedy_tokens,
            "prompt_tokens": self.prompt_tokens,
            "reference": REFERENCE,
            "fp16_max": FP16_MAX,
            "layers": self.layers,
            "variants": [r.to_dict() for r in self.results],
            "skipped": self.skipped,
            "environment": self.environment,
            **({"runtime": self.runtime} if self.runtime is not None else {}),
            "phases": self.phases,
            **({"checkpoint_reads": self.checkpoint_reads} if self.checkpoint_reads else {}),
            **({"fp16_arith": self.fp16_arith} if self.fp16_arith is not None else {}),
        }


def environment(device: torch.device | None = None) -> dict:
    """Versions and hardware, stored with every report."""
    env = {
        "halfsafe": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device) if device is not None else "cpu",
    }
    if device is not None and device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown_table(report: VerifyReport) -> str:
    """The overall results as a GitHub markdown table (for a README)."""

    def num(x, spec):
        if x is None:
            return "-"
        return "NaN" if x != x else format(x, spec)

    def size(n: int) -> str:
        return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"

    lines = [
        "| variant | custom runtime code | non-finite logits | KL(fp32 ‖ variant) per token | top-1 agreement | perplexity "
        "| greedy tokens = fp32 | max abs logit error | weights | peak activations |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.results:
        o = r.overall
        greedy = f"{o.greedy_matched}/{o.greedy_total}" if o.greedy_total else "-"
        kl = "0 (reference)" if r.name == REFERENCE else num(o.kl_mean, ".2e")
        top1 = "-" if r.name == REFERENCE else num(100 * o.top1, ".2f") + "%"
        lines.append(
            f"| {r.name} | {'yes' if r.variant.custom_runtime else 'no'} | {o.nonfinite_logits:,} | {kl} | {top1} "
            f"| {num(o.perplexity, '.3f')} | {greedy} | {num(o.max_abs_logit_error, '.3g')} | {size(r.parameter_bytes)} "
            f"| {size(r.peak_activation_bytes)} |"
        )
    return "\n".join(lines) + "\n"
