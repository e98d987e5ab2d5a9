"""halfsafe.json's fingerprint of what halfsafe wrote (src/halfsafe_serve/fingerprint.py), and the vLLM plugin's
wrapping of vLLM's dtype check (src/halfsafe_serve/vllm.py) against a stand-in for vLLM's module: what it does
where vLLM's internals moved. Real vLLM: tests/test_vllm.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import sys
import types

import pytest
import torch
from stress import make_stress
from tiny import make_tiny

from halfsafe.calibration import default_text, make_samples
from halfsafe.convert import convert_checkpoint
from halfsafe.core.forward import logits
from halfsafe.engine.write import save_fp16
from halfsafe.io import report
from halfsafe_serve import vllm as plugin
from halfsafe_serve.fingerprint import NotVerified, verified_record

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprint")
    model = make_tiny("gemma3_text")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.to(torch.bfloat16).save_pretrained(root / "original")
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    return root


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_record_fingerprints_what_was_written_before_the_file_list(converted):
    folder = converted / "converted"
    d = json.loads((folder / report.FILE).read_text())
    assert list(d)[-2:] == ["fingerprint", "files"]
    assert d["fingerprint"] == {"sha256": {n: _sha(folder / n) for n in ("config.json", "model.safetensors")}}
    assert verified_record(folder)["fingerprint"] == d["fingerprint"]
    assert report.read(folder).fingerprint == d["fingerprint"]


def test_the_in_memory_writer_is_fingerprinted_after_writing(converted, tmp_path):
    """save_pretrained's path (not streamed): the files are hashed when halfsafe.json is written."""
    model = make_tiny("llama")
    save_fp16(model, tmp_path)
    record = dataclasses.replace(report.read(converted / "converted"), fingerprint=None)
    report.write(tmp_path, record)
    d = json.loads((tmp_path / report.FILE).read_text())
    assert d["fingerprint"]["sha256"] == {n: _sha(tmp_path / n) for n in ("config.json", "model.safetensors")}


@pytest.mark.parametrize("change", ["finetune-saved-over", "edited-shard", "copied-record", "extra-shard", "no-fingerprint",
                                    "not-fp16-safe"])
def test_weights_the_record_does_not_describe_are_refused_naming_apply(converted, tmp_path, change):
    folder = tmp_path / "out"
    shutil.copytree(converted / "converted", folder)
    record = json.loads((folder / report.FILE).read_text())
    if change == "finetune-saved-over":
        model = make_tiny("gemma3_text", seed=1)
        model.half().save_pretrained(folder)
    elif change == "edited-shard":
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (folder / "model.safetensors").write_bytes(bytes(data))
    elif change == "copied-record":
        shutil.rmtree(folder)
        shutil.copytree(converted / "original", folder)
        shutil.copy(converted / "converted" / report.FILE, folder)
    elif change == "extra-shard":
        shutil.copy(folder / "model.safetensors", folder / "pytorch_model.bin")
    elif change == "no-fingerprint":  # a record from before fingerprints
        del record["fingerprint"]
        (folder / report.FILE).write_text(json.dumps(record))
    else:
        record["fp16_finite_on_calibration"] = False
        (folder / report.FILE).write_text(json.dumps(record))
    with pytest.raises(NotVerified) as e:
        verified_record(folder)
    line = str(e.value)
    assert "\n" not in line
    assert ("halfsafe apply" in line) == (change != "not-fp16-safe"), line


def _fake_vllm(monkeypatch, **names):
    """A stand-in for vllm.config.model holding `names`."""
    vllm, config, model = (types.ModuleType(n) for n in ("vllm", "vllm.config", "vllm.config.model"))
    vllm.config, config.model = config, model
    for k, v in names.items():
        setattr(model, k, v)
    for n, m in (("vllm", vllm), ("vllm.config", config), ("vllm.config.model", model)):
        monkeypatch.setitem(sys.modules, n, m)
    return model


def _check(table):
    def _get_and_verify_dtype(model_id, config, dtype, *, is_pooling_model, revision=None, config_format="hf"):
        if config.model_type in table and dtype == "float16":
            raise ValueError(f"The model type {config.model_type!r} does not support float16.")
        return dtype
    return _get_and_verify_dtype


def test_plugin_lifts_the_table_for_a_verified_folder_only(converted, monkeypatch):
    table = {"gemma3_text": "Numerical instability."}
    model = _fake_vllm(monkeypatch, _FLOAT16_NOT_SUPPORTED_MODELS=table, _get_and_verify_dtype=_check(table))
    plugin.register()
    plugin.register()  # vLLM may load plugins again: wrapped once
    wrapped = model._get_and_verify_dtype
    assert wrapped.__wrapped__.__name__ == "_get_and_verify_dtype" and not hasattr(wrapped.__wrapped__, "__wrapped__")
    gemma = types.SimpleNamespace(model_type="gemma3_text")
    assert wrapped(str(converted / "converted"), gemma, "float16", is_pooling_model=False) == "float16"
    assert table == {"gemma3_text": "Numerical instability."}  # put back
    with pytest.raises(ValueError, match="does not support float16.$"):  # not halfsafe's: vLLM's error, untouched
        wrapped(str(converted / "original"), gemma, "float16", is_pooling_model=False)
    with pytest.raises(ValueError, match="halfsafe apply"):
        wrapped(str(_copied(converted)), gemma, "float16", is_pooling_model=False)
    assert wrapped("llama", types.SimpleNamespace(model_type="llama"), "float16", is_pooling_model=False) == "float16"


def _copied(converted):
    folder = converted / "copied"
    if not folder.exists():
        shutil.copytree(converted / "original", folder)
        shutil.copy(converted / "converted" / report.FILE, folder)
    return folder


@pytest.mark.parametrize("moved", ["no-table", "renamed-parameters", "no-module"])
def test_plugin_changes_nothing_where_vllm_moved_its_internals(moved, monkeypatch, caplog):
    table = {"gemma3_text": "x"}
    if moved == "no-module":
        monkeypatch.setitem(sys.modules, "vllm", None)  # import fails
    elif moved == "no-table":
        model = _fake_vllm(monkeypatch, _get_and_verify_dtype=_check(table))
    else:
        model = _fake_vllm(monkeypatch, _FLOAT16_NOT_SUPPORTED_MODELS=table,
                           _get_and_verify_dtype=lambda model, config, dtype, *, revision=None: dtype)
    before = None if moved == "no-module" else model._get_and_verify_dtype
    with caplog.at_level(logging.INFO, logger="vllm"):
        plugin.register()
    lines = [r for r in caplog.records if r.name == "vllm.plugins.halfsafe"]
    assert len(lines) == 1 and "unchanged" in lines[0].getMessage(), [r.getMessage() for r in caplog.records]
    if before is not None:
        assert model._get_and_verify_dtype is before
