"""PNG plots: per-layer peaks against the float16 limit.

Top level: the CLI's --plot and verify/'s plots share it.

A plot's file format is its name's suffix (any format matplotlib writes: .png, .pdf, .svg, ...); a name without a
suffix gets .png added, as matplotlib does. `plot_file` says which file and format, or refuses in one line, before
the slow part; the figure is written whole or not at all (halfsafe.io.paths.write_file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from matplotlib.figure import Figure  # a Figure draws to files without pyplot, so the caller's backend is left alone

from .core.formats import FP16_MAX
from .errors import HalfsafeError
from .io.paths import write_file

_PILLOW = ("gif", "jpg", "jpeg", "tif", "tiff", "webp", "avif")  # written by Pillow, if its build has the codec


def plot_file(path: str | Path, what: str = "--plot") -> tuple[Path, str]:
    """The file a plot named `path` is written to and its format: its suffix's, or PNG at PATH.png without one;
    refused in one line when matplotlib cannot write that format here."""
    from matplotlib import rcParams
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    if not path.suffix.strip("."):
        path = path.with_name(path.name.rstrip(".") + ".png")
    fmt = path.suffix[1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        raise HalfsafeError(f"{what} {path}: matplotlib cannot write .{fmt} files; name a .png, .pdf or .svg file "
                            f"(or any of {', '.join('.' + f for f in sorted(formats))})")
    missing = None
    if fmt == "pgf" and not shutil.which(rcParams["pgf.texsystem"]):
        missing = f"{rcParams['pgf.texsystem']} (LaTeX)"
    if fmt in _PILLOW:
        from PIL import Image

        Image.init()
        if Image.registered_extensions().get("." + fmt) not in Image.SAVE:
            missing = f"Pillow's {fmt} codec"
    if missing:
        raise HalfsafeError(f"{what} {path}: writing .{fmt} needs {missing}, which is not installed; name a .png, .pdf or .svg file")
    return path, fmt


def _save(fig: Figure, path: str | Path) -> Path:
    path, fmt = plot_file(path)
    return write_file(path, lambda tmp: fig.savefig(tmp, format=fmt), "the plot")


def plot_layer_peaks(series: dict[str, list[float]], path: str | Path, title: str = "") -> Path:
    """One line per series (e.g. 'before', 'after'), layer index on x, abs max on a log y axis. Returns the file
    written (`plot_file`)."""
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    for label, peaks in series.items():
        ax.plot(range(len(peaks)), peaks, marker="o", ms=3, label=label)
    ax.axhline(FP16_MAX, color="crimson", ls="--", lw=1.2, label="float16 max (65504)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("residual stream |x| max")
    ax.set_title(title or "Residual-stream peak per layer", parse_math=False)  # a path's $ is no TeX
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def plot_bars(values: dict[str, float], path: str | Path, ylabel: str, title: str, log: bool = True) -> Path:
    """A bar per variant (e.g. KL to fp32 per precision variant). Returns the file written (`plot_file`)."""
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    names = list(values)
    ax.bar(names, [values[n] for n in names], color="steelblue")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, parse_math=False)
    ax.tick_params(axis="x", rotation=20)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)
