"""Bad input: a one-line error that names the fix, exit code 2, no traceback, nothing half-written."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import SHORT, refused
from safetensors.torch import load_file, save_file
from tiny import save_tiny

from halfsafe.cli import main


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


# --- corrupt or inconsistent input, bad options: one line, before the slow part ------------------------------------


@pytest.fixture
def model(tmp_path):
    return save_tiny("llama", tmp_path / "model")


@pytest.fixture
def no_slow_part(monkeypatch):
    monkeypatch.setattr("halfsafe.convert.make_fp16_safe", lambda *a, **k: pytest.fail("the slow part ran"))
    monkeypatch.setattr(sys.modules["halfsafe.scan"], "scan", lambda *a, **k: pytest.fail("the slow part ran"))
    monkeypatch.setattr("halfsafe.convert.steps.scan", lambda *a, **k: pytest.fail("the slow part ran"))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_weight_is_a_corrupt_checkpoint(model, tmp_path, capsys, no_slow_part, value):
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    for argv in (["convert", str(model), str(tmp_path / "out")], ["scan", str(model)], ["convert", str(model), str(tmp_path / "o"), "--whole"]):
        refused(capsys, [*argv, *SHORT], "non-finite weights in model.layers.1.mlp.up_proj.weight", "the checkpoint is corrupt")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, says", [
    ("num_hidden_layers", 100000, "num_hidden_layers 100000, but the checkpoint stores layers up to 1"),
    ("hidden_size", 10**7, "hidden_size 10000000, a size no weight"),
    ("vocab_size", 10**9, "vocab_size 1000000000"),
    ("intermediate_size", 10**7, "mlp.gate_proj.weight is [10000000, 64], but the checkpoint stores [128, 64]"),
    ("num_attention_heads", 64, "self_attn"),
])
def test_a_config_that_disagrees_with_the_weights_is_refused_fast(model, capsys, no_slow_part, field, value, says):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, field: value}))
    for extra in ([], ["--whole"]):  # fast: refused before the slow part (no_slow_part), not timed
        refused(capsys, ["scan", str(model), *extra, *SHORT], "does not match the weights", says)


def test_a_shard_larger_than_this_machine_can_map_is_refused(model, capsys):
    from halfsafe.engine.shards import mappable_bytes

    limit = mappable_bytes()
    if limit is None:
        pytest.skip("this machine maps files of any size (overcommit without limit)")
    n = limit // 2 + (1 << 30)  # bf16 elements: 2 GB more than can be mapped, stored sparse (no disk used)
    header = json.dumps({"huge": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(model / "model-huge.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * n)
    # a shard transformers reads (the index names it): a file beside model.safetensors is never read, so never mapped
    (model / "model.safetensors").rename(model / "model-small.safetensors")
    weight_map = {**{k: "model-small.safetensors" for k in load_file(model / "model-small.safetensors")}, "huge": "model-huge.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(capsys, ["scan", str(model), *SHORT], "model-huge.safetensors", "more than this machine can map")


def test_every_option_is_parsed_before_anything_loads(model, tmp_path, capsys, no_slow_part):
    out = str(tmp_path / "out")
    refused(capsys, ["convert", str(model), out, "--max-shard-size", "banana"], "argument --max-shard-size", "'banana' is not a size")
    refused(capsys, ["convert", str(model), out, "--seq-len", "-3"], "argument --seq-len")
    refused(capsys, ["convert", str(model), out, "--headroom-bits", "nan"], "--headroom-bits", "not a finite number")
    refused(capsys, ["scan", str(model), "--device", "tpu"], "unknown device 'tpu'")
    refused(capsys, ["convert", str(model)], "out")  # a missing argument: one line too
    assert not Path(out).exists()


def test_a_valid_shard_size_reaches_the_writer(model, tmp_path):
    assert main(["convert", str(model), str(tmp_path / "out"), "--max-shard-size", "100KB", *SHORT]) == 0
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
