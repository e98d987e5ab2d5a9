"""PNG plots: per-layer peaks against the float16 limit."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # a Figure draws to files without pyplot, so the caller's backend is left alone

from .core.formats import FP16_MAX


def plot_layer_peaks(series: dict[str, list[float]], path: str | Path, title: str = "") -> Path:
    """One line per series (e.g. 'before', 'after'), layer index on x, abs max on a log y axis."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    for label, peaks in series.items():
        ax.plot(range(len(peaks)), peaks, marker="o", ms=3, label=label)
    ax.axhline(FP16_MAX, color="crimson", ls="--", lw=1.2, label="float16 max (65504)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("residual stream |x| max")
    ax.set_title(title or "Residual-stream peak per layer")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_bars(values: dict[str, float], path: str | Path, ylabel: str, title: str, log: bool = True) -> Path:
    """A bar per variant (e.g. KL to fp32 per precision variant)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    names = list(values)
    ax.bar(names, [values[n] for n in names], color="steelblue")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path
