"""bench/gpu.py has not met a GPU yet: its steps run here on the CPU on a tiny model, so the script is known to
work (convert on the device, four variants loaded, timed and checked) when one is at hand."""

from __future__ import annotations

from pathlib import Path

from halfsafe.calibration import default_text, make_samples
from halfsafe.forward import logits
from tests.stress import make_stress
from tests.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_runs_its_steps_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu

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
