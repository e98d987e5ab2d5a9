"""bench/cost/convert_cost.py's report from a saved result (the real run takes minutes: bench/results/convert_cost-*.json),
and its one measured part small enough for the suite: the forward alone of a tiny checkpoint, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def convert_cost(bench_script):
    return bench_script("cost", "convert_cost")


def test_the_report_reads_the_ratio_and_the_goals(convert_cost):
    saved = json.loads((ROOT / "bench/results/convert_cost-qwen7b.json").read_text())
    text = convert_cost.markdown(saved)
    assert f"**{saved['convert_over_forward']:.2f}x** (goal <= 1.3x)" in text
    assert f"**{saved['convert_cpu_s_per_billion']:.0f} CPU-s** (goal <= 100)" in text
    assert "float32 " in text and "GFLOP/s" in text and "scan " in text
    assert saved["convert_over_forward"] == pytest.approx(saved["convert"]["cpu_s"] / saved["forward"]["forward_cpu_s"])


def test_a_bfloat16_calibrations_figures_are_kept_beside_float32s(convert_cost):
    assert convert_cost.result_stem("1.2b", "float32") == "convert_cost-1.2b"
    assert convert_cost.result_stem("1.2b", "bfloat16") == "convert_cost-1.2b-bfloat16"
    for path in (ROOT / "bench/results").glob("convert_cost-*-bfloat16.json"):
        assert json.loads(path.read_text())["calib_arith"]["used"] == "bfloat16", path


def test_the_forward_alone_runs_the_calibration_samples_in_step(tmp_path):
    save_tiny("llama", tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "bench/cost/convert_cost.py"), "--forward-only", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["samples"] >= 1 and out["tokens"] > 0 and out["forward_cpu_s"] > 0
