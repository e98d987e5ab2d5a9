"""halfsafe.json's fingerprint of what halfsafe wrote (src/halfsafe_serve/fingerprint.py), the folders verified and
known by their files' identities since (src/halfsafe_serve/verified.py), and the vLLM plugin's wrapping of vLLM's dtype
check (src/halfsafe_serve/vllm.py) against a stand-in for vLLM's module: the config vLLM runs compared with the
fingerprinted one, the one lock, a hub id's revision, what it does where vLLM's internals moved. Real vLLM:
tests/test_vllm.py."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stress import make_stress
from tiny import make_tiny
from transformers import AutoConfig

from halfsafe.calibration import default_text, make_samples
from halfsafe.convert import convert_checkpoint
from halfsafe.core.forward import logits
from halfsafe.engine.write import save_fp16
from halfsafe.io import report
from halfsafe_serve import fingerprint
from halfsafe_serve import verified as verified_cache
from halfsafe_serve import vllm as plugin
from halfsafe_serve.fingerprint import NotVerified, verified_record

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own halfsafe cache folder and an empty in-process memory of verified folders."""
    monkeypatch.setenv("HALFSAFE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verified_cache, "_memory", {})
    return tmp_path / "cache"


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
                                    "not-fp16-safe", "config-number", "config-text"])
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
    elif change in ("config-number", "config-text"):  # config.json alone: the weights are still the ones written
        config = json.loads((folder / "config.json").read_text())
        if change == "config-number":
            config["rms_norm_eps"] = 1e-6  # the original's eps over the rescaled one
        else:
            config["hidden_activation"] = "gelu"
        (folder / "config.json").write_text(json.dumps(config, indent=2))
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
    if change.startswith("config-"):
        assert "config.json is not the file halfsafe wrote" in line, line


def _read_config(model, trust_remote_code, revision=None, code_revision=None, config_format="auto", **kwargs):
    """vllm.transformers_utils.config.get_config's stand-in: transformers' reader of a folder's config.json (what
    vLLM's calls for a local folder with no overrides: tests/test_vllm.py compares them in real vLLM)."""
    return AutoConfig.from_pretrained(model)


def _fake_vllm(monkeypatch, reader=_read_config, **names):
    """A stand-in for vllm.config.model holding `names`, and vllm.transformers_utils.config holding `reader`."""
    mods = {n: types.ModuleType(n) for n in ("vllm", "vllm.config", "vllm.config.model", "vllm.transformers_utils",
                                             "vllm.transformers_utils.config")}
    mods["vllm"].config, mods["vllm.config"].model = mods["vllm.config"], mods["vllm.config.model"]
    mods["vllm"].transformers_utils = mods["vllm.transformers_utils"]
    mods["vllm.transformers_utils"].config = mods["vllm.transformers_utils.config"]
    if reader is not None:
        mods["vllm.transformers_utils.config"].get_config = reader
    for k, v in names.items():
        setattr(mods["vllm.config.model"], k, v)
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    return mods["vllm.config.model"]


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
    gemma = AutoConfig.from_pretrained(converted / "converted")
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


@pytest.mark.parametrize("moved", ["no-table", "renamed-parameters", "no-config-reader", "no-module"])
def test_plugin_changes_nothing_where_vllm_moved_its_internals(moved, monkeypatch, caplog):
    table = {"gemma3_text": "x"}
    if moved == "no-module":
        monkeypatch.setitem(sys.modules, "vllm", None)  # import fails
    elif moved == "no-table":
        model = _fake_vllm(monkeypatch, _get_and_verify_dtype=_check(table))
    elif moved == "no-config-reader":
        model = _fake_vllm(monkeypatch, reader=None, _FLOAT16_NOT_SUPPORTED_MODELS=table, _get_and_verify_dtype=_check(table))
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


# ----------------------------------------------------------------------------------------------------------------
# The config vLLM runs against the config.json halfsafe.json fingerprinted
# ----------------------------------------------------------------------------------------------------------------


def _plugin(monkeypatch):
    table = {"gemma3_text": "Numerical instability."}
    model = _fake_vllm(monkeypatch, _FLOAT16_NOT_SUPPORTED_MODELS=table, _get_and_verify_dtype=_check(table))
    plugin.register()
    return model._get_and_verify_dtype, table


@pytest.mark.parametrize("how", ["override", "another-config-path", "added-field", "same-config-elsewhere", "dtype-field"])
def test_the_config_vllm_runs_must_be_the_fingerprinted_one(converted, monkeypatch, tmp_path, how):
    """vLLM builds the config it runs from --hf-overrides (config.update) or --hf-config-path: the original's
    rms_norm_eps over the rescaled one is refused, naming the field and both values; the same config read from
    another path, or another dtype field, is not a difference."""
    wrapped, table = _plugin(monkeypatch)
    folder = converted / "converted"
    config = AutoConfig.from_pretrained(folder)
    rescaled = config.rms_norm_eps
    if how == "override":
        config.update({"rms_norm_eps": 1e-6})
    elif how == "another-config-path":
        config = AutoConfig.from_pretrained(converted / "original")
    elif how == "added-field":
        config.update({"logits_scale": 2.0})
    elif how == "same-config-elsewhere":
        shutil.copy(folder / "config.json", tmp_path / "config.json")
        config = AutoConfig.from_pretrained(tmp_path)
    else:
        config.update({"dtype": "bfloat16"})
    if how in ("same-config-elsewhere", "dtype-field"):
        assert wrapped(str(folder), config, "float16", is_pooling_model=False) == "float16"
        return
    with pytest.raises(ValueError) as e:
        wrapped(str(folder), config, "float16", is_pooling_model=False)
    line = str(e.value)
    assert "does not support float16" in line and "\n" not in line and "--hf-overrides" in line, line
    if how == "added-field":
        assert "logits_scale 2.0 (the config vLLM runs) != '<absent>' (config.json)" in line, line
    else:
        assert f"rms_norm_eps 1e-06 (the config vLLM runs) != {rescaled!r} (config.json)" in line, line
    assert table == {"gemma3_text": "Numerical instability."}


def _leaves(d: dict, prefix: tuple = ()):
    """The key paths of `d`'s leaves (a non-empty dict is not a leaf)."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k)


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def _get(d: dict, path: tuple):
    for k in path:
        d = d[k]
    return d


def _set(d: dict, path: tuple, value) -> None:
    _get(d, path[:-1])[path[-1]] = value


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return 0.0 if math.isinf(v) else v + 1 if v + 1 != v else v * 2
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return [*v, v[-1] if v else 0]
    return 1 if v is None else None


def test_every_field_of_a_real_config_but_the_ignored_ones_is_compared(converted):
    """Each leaf of the converted Gemma 3 text config's to_dict, changed alone, is the one difference named;
    IGNORED's fields changed are none."""
    reference = AutoConfig.from_pretrained(converted / "converted").to_dict()
    leaves = list(_leaves(reference))
    assert ("rms_norm_eps",) in leaves and ("rope_parameters", "full_attention", "rope_theta") in leaves, leaves
    for path in leaves:
        ours = copy.deepcopy(reference)
        _set(ours, path, _changed(_get(ours, path)))
        got = [field for field, _, _ in plugin.differences(ours, reference)]
        assert got == ([] if path[-1] in plugin.IGNORED else [_dotted(path)]), path


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(config=st.dictionaries(st.text(max_size=6), _json, min_size=1, max_size=6), data=st.data())
def test_differences_name_exactly_the_changed_field_at_any_depth(config, data):
    """A property over nested configs: one leaf changed or removed is the one field named (dotted, in a sub-config
    too); the same config is no difference; an IGNORED field changes nothing."""
    reference = copy.deepcopy(config)
    assert plugin.differences(config, reference) == []
    paths = [p for p in _leaves(config) if not set(p) & plugin.IGNORED]
    if paths:
        path = data.draw(st.sampled_from(paths))
        ours = copy.deepcopy(config)
        value = _get(ours, path)
        _set(ours, path, _changed(value))
        assert [f for f, _, _ in plugin.differences(ours, reference)] == [_dotted(path)]
        del _get(ours, path[:-1])[path[-1]]
        assert plugin.differences(ours, reference) == [(_dotted(path), "<absent>", value)]
    ignored = data.draw(st.sampled_from(sorted(plugin.IGNORED)))
    ours = copy.deepcopy(reference)
    ours[ignored] = "changed"
    assert plugin.differences(ours, reference) == []


# ----------------------------------------------------------------------------------------------------------------
# One lock for every call of a listed model type
# ----------------------------------------------------------------------------------------------------------------


class _SeenLock:
    """The plugin's lock, telling when the thread named "unverified" would have to wait for it (sets `waiting`)."""

    def __init__(self, waiting: threading.Event):
        self._lock, self._waiting = threading.Lock(), waiting

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            if threading.current_thread().name == "unverified":
                self._waiting.set()
            self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


@pytest.mark.parametrize("order", ["unverified-starts-during-the-lift", "unverified-checked-before-the-lift"])
def test_a_call_during_a_lift_does_not_see_it(converted, monkeypatch, order):
    """While a verified folder's call is inside vLLM's function with the entry lifted, an unverified folder's call is
    refused: it waits for the lock, or (without it) reaches vLLM's function during the lift and is allowed. Either
    it starts then, or its record was checked before the lift and it comes to vLLM's function during it. The verified
    call is held inside vLLM's function until the other waits for the lock or has got into that function: no sleeps."""
    table = {"gemma3_text": "Numerical instability."}
    inside, release, progressed, checking = (threading.Event() for _ in range(4))
    check = _check(table)

    def original(model_id, config, dtype, *, is_pooling_model, revision=None, config_format="hf"):
        if threading.current_thread().name == "verified":
            inside.set()
            release.wait()
        else:
            progressed.set()
        return check(model_id, config, dtype, is_pooling_model=is_pooling_model)

    def verified(folder):  # the real check; the unverified call's waits, after its turn at the table, for the lift
        if threading.current_thread().name == "unverified" and order == "unverified-checked-before-the-lift":
            checking.set()
            inside.wait()
        return verified_cache.verified(folder)

    model = _fake_vllm(monkeypatch, _FLOAT16_NOT_SUPPORTED_MODELS=table, _get_and_verify_dtype=original)
    plugin.register()
    monkeypatch.setattr(plugin, "_lock", _SeenLock(progressed))
    monkeypatch.setattr(plugin, "verified", verified)
    wrapped, results = model._get_and_verify_dtype, {}

    def call(name, folder):
        try:
            results[name] = wrapped(str(folder), AutoConfig.from_pretrained(folder), "float16", is_pooling_model=False)
        except ValueError as e:
            results[name] = e

    first = threading.Thread(target=call, args=("verified", converted / "converted"), name="verified")
    second = threading.Thread(target=call, args=("unverified", _copied(converted)), name="unverified")
    if order == "unverified-starts-during-the-lift":
        first.start()
        inside.wait()
        second.start()
    else:
        second.start()
        checking.wait()  # past the table's membership, checking its record
        first.start()
    progressed.wait()  # the second call waits for the lock, or is already inside vLLM's function
    release.set()
    first.join()
    second.join()
    assert results["verified"] == "float16"
    assert isinstance(results["unverified"], ValueError) and "halfsafe apply" in str(results["unverified"]), results
    assert table == {"gemma3_text": "Numerical instability."}


# ----------------------------------------------------------------------------------------------------------------
# A verified folder is known by its files' identities, in this process and across processes
# ----------------------------------------------------------------------------------------------------------------


def _counting(monkeypatch) -> list:
    """The names of the files fingerprint hashes from now on (the real hashing runs)."""
    hashed, real = [], fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    return hashed


_IN_ANOTHER_PROCESS = """
import sys
from halfsafe_serve import fingerprint
from halfsafe_serve.verified import verified
hashed, real = [], fingerprint.sha256_file
fingerprint.sha256_file = lambda path: hashed.append(path.name) or real(path)
verified(sys.argv[1])
print(len(hashed))
"""


def test_a_verified_folder_is_hashed_once_then_known_by_identity(converted, tmp_path, monkeypatch, own_cache):
    folder = shutil.copytree(converted / "converted", tmp_path / "out")
    hashed = _counting(monkeypatch)
    record = verified_cache.verified(folder)
    assert sorted(hashed) == ["config.json", "model.safetensors"] and record == verified_record(folder)
    hashed.clear()
    assert verified_cache.verified(folder) == record and hashed == []  # this process remembers
    monkeypatch.setattr(verified_cache, "_memory", {})
    assert verified_cache.verified(folder) == record and hashed == []  # the cache file remembers
    assert (own_cache / verified_cache.NAME).stat().st_mode & 0o077 == 0
    another = subprocess.run([sys.executable, "-c", _IN_ANOTHER_PROCESS, str(folder)], capture_output=True, text=True,
                             env={**os.environ, "HALFSAFE_CACHE": str(own_cache)}, check=True)
    assert another.stdout.split()[-1] == "0"  # so does another process
    assert json.loads((own_cache / verified_cache.NAME).read_text())["folders"].keys() == {str(folder.resolve())}


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", report.FILE])
@pytest.mark.parametrize("change", ["touched", "replaced", "edited-mtime-kept"])
def test_any_identity_change_hashes_again(converted, tmp_path, monkeypatch, name, change):
    """A file touched (its ctime moves) or put in place of itself (another inode) is hashed again and still
    verifies; one byte edited with its size and mtime kept is hashed again and refused."""
    folder = shutil.copytree(converted / "converted", tmp_path / "out")
    verified_cache.verified(folder)
    path = folder / name
    st = path.stat()
    if change == "touched":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "replaced":
        shutil.copy2(path, tmp_path / "copy")
        os.replace(tmp_path / "copy", path)
    else:
        data = bytearray(path.read_bytes())
        if name == "model.safetensors":  # the low mantissa bit of the last tensor's last element
            data[-1] ^= 1
        else:  # a digit: config.json's rms_norm_eps, or the shard's digest in halfsafe.json's fingerprint
            at = data.index(b"2.4") if name == "config.json" else data.rindex(b'"model.safetensors": "') + 22
            data[at] = ord("a") if data[at] != ord("a") else ord("b")
        path.write_bytes(bytes(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    hashed = _counting(monkeypatch)
    if change == "edited-mtime-kept":
        with pytest.raises(NotVerified, match="is not the file halfsafe wrote"):
            verified_cache.verified(folder)
        assert hashed and (name in hashed or name == report.FILE), hashed  # read again up to the first mismatch
    else:
        verified_cache.verified(folder)
        assert sorted(hashed) == ["config.json", "model.safetensors"]  # the whole folder again


@pytest.mark.parametrize("cache", ["ours", "garbage", "another-format", "malformed-entry", "writable-by-others",
                                   "another-owner", "a-link"])
def test_a_cache_file_not_this_users_alone_or_malformed_is_ignored(converted, tmp_path, monkeypatch, own_cache, cache):
    """A cache entry that names the folder's files as they are now with the digests halfsafe.json records, over an
    edited shard: this user's own file is believed (what the cache is for: the control), any other is ignored and the
    shard is hashed and refused."""
    if cache == "another-owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another owner needs root")
    folder = shutil.copytree(converted / "converted", tmp_path / "out")
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    entry = {"files": verified_cache.identities(folder),
             "sha256": json.loads((folder / report.FILE).read_text())["fingerprint"]["sha256"]}
    if cache == "malformed-entry":
        entry["files"] = {k: [str(x) for x in v] for k, v in entry["files"].items()}
    data = {"format": 2 if cache == "another-format" else 1, "folders": {str(folder.resolve()): entry}}
    own_cache.mkdir()
    path = own_cache / verified_cache.NAME
    target = tmp_path / "elsewhere.json" if cache == "a-link" else path
    target.write_text("{not json" if cache == "garbage" else json.dumps(data))
    target.chmod(0o666 if cache == "writable-by-others" else 0o600)
    if cache == "another-owner":
        os.chown(target, os.geteuid() + 1, -1)
    if cache == "a-link":
        path.symlink_to(target)
    if cache == "ours":
        verified_cache.verified(folder)
        return
    with pytest.raises(NotVerified, match="model.safetensors is not the file halfsafe wrote"):
        verified_cache.verified(folder)


def test_the_cache_file_keeps_the_most_recently_verified_folders(converted, tmp_path, monkeypatch, own_cache):
    monkeypatch.setattr(verified_cache, "KEEP", 2)
    """The file keeps the KEEP folders hashed last: one hashed again (a file touched) is the newest."""
    folders = [shutil.copytree(converted / "converted", tmp_path / f"out{i}") for i in range(3)]
    for i in (0, 1, 1, 0, 2):  # the second out1: known from the file
        if i == 0 and (own_cache / verified_cache.NAME).exists():
            os.utime(folders[0] / "config.json")
        verified_cache.verified(folders[i])
        monkeypatch.setattr(verified_cache, "_memory", {})
    kept = json.loads((own_cache / verified_cache.NAME).read_text())["folders"]
    assert list(kept) == [str(folders[0].resolve()), str(folders[2].resolve())]


def test_cached_digests_are_still_compared_with_the_record(converted, tmp_path, own_cache):
    """An entry whose identities hold but whose digests are not the ones halfsafe.json records verifies nothing."""
    folder = shutil.copytree(converted / "converted", tmp_path / "out")
    entry = {"files": verified_cache.identities(folder), "sha256": {"config.json": "0" * 64, "model.safetensors": "1" * 64}}
    own_cache.mkdir()
    (own_cache / verified_cache.NAME).write_text(json.dumps({"format": 1, "folders": {str(folder.resolve()): entry}}))
    (own_cache / verified_cache.NAME).chmod(0o600)
    with pytest.raises(NotVerified, match="config.json is not the file halfsafe wrote"):
        verified_cache.verified(folder)


def test_the_cache_folder_rule_is_halfsafes(monkeypatch, tmp_path):
    from halfsafe.io.cache import cache_dir

    for value in (str(tmp_path / "c"), None):
        if value is None:
            monkeypatch.delenv("HALFSAFE_CACHE")
        else:
            monkeypatch.setenv("HALFSAFE_CACHE", value)
        assert verified_cache.cache_file() == cache_dir() / verified_cache.NAME


# ----------------------------------------------------------------------------------------------------------------
# A hub id: the snapshot in the local cache at the revision asked for
# ----------------------------------------------------------------------------------------------------------------


def test_a_hub_cache_snapshot_is_found_at_its_revision_only(converted, tmp_path, monkeypatch):
    """huggingface_hub's cache layout (models--org--name/refs/<ref> holds a commit, snapshots/<commit>/ the files):
    the plugin finds the snapshot of the revision asked (a ref or a commit), and none for another revision."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--org--name"
    main, v2 = "a" * 40, "b" * 40
    for commit in (main, v2):
        shutil.copytree(converted / "converted", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    (repo / "refs" / "v2").write_text(v2)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert plugin.local_folder("org/name") == repo / "snapshots" / main
    assert plugin.local_folder("org/name", "main") == repo / "snapshots" / main
    assert plugin.local_folder("org/name", "v2") == repo / "snapshots" / v2
    assert plugin.local_folder("org/name", v2) == repo / "snapshots" / v2
    assert plugin.local_folder("org/name", "c" * 40) is None
    assert plugin.local_folder("org/name", "v3") is None
    assert plugin.local_folder("org/other") is None
    # through vLLM's call: the revision it passes is the one looked up (v2's snapshot is halfsafe's, "v3" is unknown)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    shutil.rmtree(repo / "snapshots" / main)
    shutil.copytree(converted / "original", repo / "snapshots" / main)
    shutil.copy(converted / "converted" / report.FILE, repo / "snapshots" / main)
    wrapped, _ = _plugin(monkeypatch)
    config = AutoConfig.from_pretrained(converted / "converted")
    assert wrapped("org/name", config, "float16", is_pooling_model=False, revision="v2") == "float16"
    with pytest.raises(ValueError, match="halfsafe apply"):  # main's snapshot: the original's weights, the record copied
        wrapped("org/name", config, "float16", is_pooling_model=False, revision="main")
    with pytest.raises(ValueError, match="does not support float16.$"):
        wrapped("org/name", config, "float16", is_pooling_model=False, revision="v3")


def test_the_plugin_imports_only_the_standard_library_until_vllm_calls_it():
    """vLLM imports the entry point in each of its processes: halfsafe_serve.vllm brings in nothing but the standard
    library (no torch, transformers, halfsafe or huggingface_hub) before `register` runs."""
    code = ("import sys; before = set(sys.modules); import halfsafe_serve.vllm; "
            "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    brought = set(done.stdout.split()) - {"halfsafe_serve"}
    assert brought <= set(sys.stdlib_module_names), sorted(brought - set(sys.stdlib_module_names))
