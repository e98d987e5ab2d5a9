"""Importing halfsafe is light and leaves the caller's settings alone."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_does_not_load_the_trainer_callback_or_pyplot():
    out = _run("import sys, halfsafe; print('halfsafe.training.callback' in sys.modules, 'matplotlib.pyplot' in sys.modules)")
    assert out == "False False"
    assert _run("import halfsafe; print(halfsafe.HeadroomCallback.__name__)") == "HeadroomCallback"


def test_plots_keep_the_callers_matplotlib_backend(tmp_path):
    code = (f"import matplotlib; matplotlib.use('svg'); from halfsafe.plots import plot_layer_peaks; "
            f"plot_layer_peaks({{'a': [1.0, 2e5]}}, r'{tmp_path / 'p.png'}'); print(matplotlib.get_backend())")
    assert _run(code) == "svg"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
