"""The report's two figures: divergence per variant, and the residual peak per block before and after.

matplotlib is imported only when a figure is drawn: `verify` itself does not need it.
"""

from __future__ import annotations

import math
from pathlib import Path

from .report import VerifyReport
from .variants import FP16, HALFSAFE, REFERENCE


def plot_files(path: str | Path) -> list[Path]:
    """The two files `write_plots` writes for PATH (halfsafe.plots.plot_file: a name without a suffix is a PNG)."""
    from ..plots import plot_file  # halfsafe.plots imports matplotlib: only once a figure is asked for

    path = plot_file(path)[0]
    return [path, path.with_name(f"{path.stem}-layers{path.suffix}")]


def write_plots(report: VerifyReport, path: str | Path) -> list[Path]:
    """PATH: KL(fp32 || variant) per token as bars on a log axis (a non-finite variant gets a label, no bar).
    PATH with `-layers` before the suffix: residual peak per block, original (fp32 run) and converted (fp16
    run), against the fp16 limit."""
    from ..plots import plot_bars, plot_layer_peaks  # matplotlib, as above

    path, layers = plot_files(path)
    bars = {}
    for r in report.results:
        if r.name == REFERENCE:
            continue
        kl = r.overall.kl_mean
        bars[r.name if math.isfinite(kl) else f"{r.name}\n(non-finite)"] = kl if math.isfinite(kl) else math.nan
    written = [plot_bars(bars, path, "mean KL(fp32 || variant) per token (nats)", f"{report.model}: divergence from float32, lower is better")]
    series = {"original (fp32 run)": report.result(REFERENCE).layer_peaks}
    for name in (HALFSAFE, FP16):
        try:
            peaks = report.result(name).layer_peaks
        except KeyError:
            continue
        if all(math.isfinite(p) for p in peaks):
            series[f"{name} (measured)"] = peaks
            break
    written.append(plot_layer_peaks(series, layers, f"{report.model}: residual peak per layer, before and after"))
    return written
