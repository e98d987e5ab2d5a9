"""`halfsafe scan`: real Gemma 3 overflow, tiny models of several families, the JSON schema and plot."""

from __future__ import annotations

import json

import pytest
from tiny import save_tiny

from halfsafe.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _scan(tmp_path, model: str, *extra: str) -> dict:
    out = tmp_path / "scan.json"
    assert main(["scan", model, "--json", str(out), "--max-samples", "2", "--seq-len", "64", *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("key", ["llama", "gemma3_text", "t5-v1_1", "gpt2", "bert"])
def test_scan_tiny_models_writes_json_and_png(tmp_path, key):
    folder = save_tiny(key, tmp_path / key)
    png = tmp_path / "peaks.png"
    data = _scan(tmp_path, str(folder), "--plot", str(png))
    assert isinstance(data["fp16_safe"], bool)
    assert data["modules"], "no module was measured"
    for m in data["modules"]:
        assert {"name", "class", "abs_max", "headroom_bits"} <= set(m)
        assert isinstance(m["name"], str) and isinstance(m["class"], str)
        assert m["abs_max"] >= 0
    assert data["layers"], "no repeated blocks found"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 2000


def test_tiny_model_that_fits_is_fp16_safe(tmp_path):
    data = _scan(tmp_path, str(save_tiny("llama", tmp_path / "m")))
    assert data["fp16_safe"] is True
    assert data["peak"]["abs_max"] < 65504


@pytest.mark.slow
def test_scan_real_gemma3_overflows_in_the_layers(tmp_path, gemma3_folder):
    data = _scan(tmp_path, str(gemma3_folder), "--fp16-check", "--seq-len", "128")
    assert data["fp16_safe"] is False
    assert data["peak"]["abs_max"] > 65504
    assert data["peak"]["name"].startswith("model.layers.")
    over = [m for m in data["modules"] if m["headroom_bits"] < 0]
    assert over and all(m["name"].startswith("model.layers.") for m in over)
    first = data["fp16_check"]["first_nonfinite_module"]
    assert first and first.startswith("model.layers.")


def test_formats_shows_bf16_rounding(capsys):
    assert main(["formats", "--value", "283", "--times", "10"]) == 0
    out = capsys.readouterr().out
    assert "2848" in out  # 283 * 10 in bfloat16
    assert "65504" in out
