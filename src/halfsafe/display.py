"""Rich tables for the terminal."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .formats import FormatInfo
from .scan import ScanReport
from .stats import PERCENTILE


def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 or x != x else f"{x:.3e}"


def headroom_cell(bits: float) -> str:
    color = "red" if bits < 0 else "yellow" if bits < 2 else "green"
    return f"[{color}]{bits:+.2f}[/]"


def scan_tables(report: ScanReport, console: Console, top: int = 12) -> None:
    layers = Table(title=f"Residual stream per layer: {report.model}", title_justify="left")
    for col in ("layer", "residual |x| max", "headroom bits", "largest inside", "at"):
        layers.add_column(col, justify="right" if col != "at" and col != "layer" else "left")
    for l in report.layers:
        layers.add_row(l.name, fmt(l.residual_peak), headroom_cell(l.headroom_bits), fmt(l.inner_peak), l.inner_site)
    console.print(layers)

    worst = Table(title=f"Tightest {top} tensors (of {len(report.sites)} measured)", title_justify="left")
    for col in ("site", "class", "|x| max", f"p{PERCENTILE:g}", "> 65504", "subnormal frac", "headroom bits"):
        worst.add_column(col, justify="left" if col in ("site", "class") else "right")
    for s in report.worst(top):
        worst.add_row(s.name, s.module_class, fmt(s.abs_max), fmt(s.percentile), str(s.above_fp16_max),
                      f"{s.underflow_fraction:.2%}", headroom_cell(s.headroom_bits))
    console.print(worst)
    peak = report.peak
    verdict = "[green]fp16_safe: true[/]" if report.fp16_safe else "[red]fp16_safe: false[/]"
    console.print(f"{verdict}  peak {fmt(peak.abs_max)} at {peak.name} ({peak.headroom_bits:+.2f} bits) over "
                  f"{report.n_tokens} tokens in {report.n_samples} samples")
    if report.fp16_checked:
        where = report.first_nonfinite_fp16
        console.print(f"fp16 run: first non-finite output at [bold]{where}[/]" if where else "fp16 run: all outputs finite")


def formats_table(formats: list[FormatInfo], console: Console) -> None:
    t = Table(title="Float formats")
    for col in ("format", "max finite", "min normal", "min subnormal", "mantissa bits", "spacing near 1"):
        t.add_column(col, justify="right" if col != "format" else "left")
    for f in formats:
        t.add_row(f.name, f"{f.max:.6g}", f"{f.min_normal:.3g}", f"{f.min_subnormal:.3g}", str(f.mantissa_bits), f"{f.spacing_near_one:.3g}")
    console.print(t)
