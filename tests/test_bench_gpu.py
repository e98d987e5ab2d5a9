"""bench/cost/gpu.py has not met a GPU yet: its steps run here on the CPU on a tiny model, so the script is known to
work (convert on the device, four variants loaded, timed and checked) when one is at hand."""

from __future__ import annotations

import json
from pathlib import Path

from halfsafe.calibration import default_text, make_samples
from halfsafe.core.forward import logits
from tests.stress import make_stress
from tests.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_runs_its_steps_on_the_cpu(tmp_path, bench_script):
    gpu = bench_script("cost", "gpu")

    model = make_tiny("llama")
    calib = make_samples([default_text()], None, 256, 16, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])  # its residual stream overflows fp16
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "gpu.md"
    assert gpu.main([str(tmp_path / "model"), "--device", "cpu", "--out", str(out), "--batch", "2", "--seq-len", "16",
                     "--new-tokens", "2"]) == 0
    table = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in table.splitlines() if line.startswith("| ") and "variant" not in line}
    assert set(rows) == {"bf16", "fp16 original", "fp16 + fp32 residual", "halfsafe fp16"}
    assert rows["halfsafe fp16"] == "True" and rows["fp16 original"] == "False", table
    assert "CPU (a check that the script runs, not a measurement)" in table


def _stress_llama(folder: Path) -> None:
    model = make_tiny("llama")
    calib = make_samples([default_text()], None, 256, 16, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.save_pretrained(folder)


def test_gpu_scale_runs_convert_and_verify_with_the_cli_on_the_cpu(tmp_path, bench_script):
    """`--scale` (bench/cost/scale_7b.py's convert + verify on one device) as a dry run: the real CLI commands, their
    reports read back, the result JSON written."""
    gpu = bench_script("cost", "gpu")

    _stress_llama(tmp_path / "model")
    assert gpu.main(["--scale", "tiny-llama", "--checkpoint", str(tmp_path / "model"), "--device", "cpu",
                     "--work", str(tmp_path / "work"), "--results", str(tmp_path), "--samples", "1", "--calib-seq-len", "16",
                     "--seq-len", "16", "--greedy-tokens", "2", "--time-limit", "300"]) == 0
    result = json.loads((tmp_path / "gpu_scale_tiny-llama.json").read_text())
    assert result["measurement"] is False and result["params"] > 0
    assert {n: s["exit"] for n, s in result["steps"].items()} == {"convert": 0, "verify": 0}
    assert all(s["wall_s"] > 0 and s["argv"][0] == "timeout" for s in result["steps"].values())
    assert result["variants"]["halfsafe fp16"]["nonfinite_logits"] == 0
    assert result["variants"]["fp16"]["nonfinite_logits"] > 0  # the stress model overflows plain fp16
    assert 0 < result["variants"]["halfsafe fp16"]["kl_mean"] < result["variants"]["fp16 clamp"]["kl_mean"]
    assert not (tmp_path / "work" / "model-fp16").exists()  # the output is removed unless --keep-output


def test_gpu_scale_stops_at_its_time_limit(tmp_path, bench_script):
    gpu = bench_script("cost", "gpu")

    _stress_llama(tmp_path / "model")
    assert gpu.main(["--scale", "tiny-llama", "--checkpoint", str(tmp_path / "model"), "--device", "cpu",
                     "--work", str(tmp_path / "work"), "--results", str(tmp_path), "--time-limit", "5"]) == 1
    steps = json.loads((tmp_path / "gpu_scale_tiny-llama.json").read_text())["steps"]
    assert steps == {"convert": {"exit": None, "skipped": "no time left"}}
