"""Bad input: a one-line error that names the fix, exit code 2, no traceback, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from halfsafe.cli import main
from tiny import save_tiny


def _run(capsys, *argv: str) -> str:
    capsys.readouterr()  # drop what building the test model printed
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_path(capsys, tmp_path):
    err = _run(capsys, "scan", str(tmp_path / "nope"))
    assert "does not exist" in err and "folder" in err


def test_folder_without_a_model(capsys, tmp_path):
    assert "config.json" in _run(capsys, "scan", str(tmp_path))


def test_config_without_weights(capsys, tmp_path):
    folder = save_tiny("llama", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    assert "no weights" in _run(capsys, "scan", str(folder))


def test_unknown_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "architectures": ["NoSuchModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    err = _run(capsys, "scan", str(tmp_path))
    assert "no_such_arch" in err and "unknown" in err


def test_corrupt_safetensors(capsys, tmp_path):
    folder = save_tiny("llama", tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    err = _run(capsys, "scan", str(folder))
    assert "corrupt" in err and "re-download" in err


def test_empty_text_file(capsys, tmp_path):
    folder = save_tiny("llama", tmp_path / "m")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert "empty" in _run(capsys, "scan", str(folder), "--text", str(empty))


def test_missing_text_file(capsys, tmp_path):
    folder = save_tiny("llama", tmp_path / "m")
    assert "--text" in _run(capsys, "scan", str(folder), "--text", str(tmp_path / "missing.txt"))


def test_convert_refuses_existing_output(capsys, tmp_path):
    folder = save_tiny("llama", tmp_path / "m")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "--overwrite" in _run(capsys, "convert", str(folder), str(out))
    assert (out / "keep.txt").read_text() == "mine"


def test_convert_unsupported_family_lists_supported(capsys, tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=32)
    OPTForCausalLM(cfg).save_pretrained(tmp_path / "opt")
    err = _run(capsys, "convert", str(tmp_path / "opt"), str(tmp_path / "out"))
    assert "'opt'" in err and "llama" in err and "supported" in err
    assert not (tmp_path / "out").exists()


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "halfsafe.cli", "scan", str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("error:")
