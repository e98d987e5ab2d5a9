"""halfsafe deletes, renames or replaces only folders it can prove it made.

Beside OUT: a folder named like a leftover (`.OUT.tmp-*`, `.OUT.old-*`, the fine-tune's `.OUT.partial`) is removed
or moved back only when its mark (io.owned) proves a halfsafe run of this user made it for OUT and that run has
ended; a user's folder of such a name (no mark, a forged or copied one, one made under another key or for another
OUT, a symbolic link to a real leftover) survives byte for byte, with one warning line naming it. OUT itself:
--overwrite replaces it only when its halfsafe.json reads as a record and it holds no file that record does not
list (or it is empty); an empty halfsafe.json, `{}`, a `scan --json` report, a linked one, or a real record beside a
file of the user's is refused in one line, and the folder is left as it was. (Killed runs and racing runs:
test_faults.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from hostile import SHORT, folder_hash, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import save_tiny

from halfsafe.cli import main
from halfsafe.errors import HalfsafeError
from halfsafe.io import owned, report
from halfsafe.io.checkpoint import atomic_folder, check_out_dir, clean_stale
from halfsafe.io.report import Record
from halfsafe_serve.fingerprint import verified_record

PROPERTY = settings(max_examples=15, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def own_key(tmp_path_factory, monkeypatch):
    """A key of this test's own (the user's cache folder is left alone)."""
    monkeypatch.setenv("HALFSAFE_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> Path:
    """A real `halfsafe convert` output (copied before each use)."""
    out = tmp_path_factory.mktemp("converted") / "out"
    assert main(["convert", str(tiny), str(out), *SHORT]) == 0
    return out


@pytest.fixture(scope="module")
def scan_json(tiny, tmp_path_factory) -> Path:
    """What `halfsafe scan --json proj/halfsafe.json` writes: JSON, but no record."""
    path = tmp_path_factory.mktemp("proj") / "halfsafe.json"
    assert main(["scan", str(tiny), "--json", str(path), *SHORT]) == 0
    return path


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _mark(at: Path, out: Path, kind: str, **changes) -> dict:
    """A mark as halfsafe writes it into folder `at` (proof included), with `changes` made before it is signed."""
    fields = {"halfsafe": kind, "out": out.name, "run": uuid.uuid4().hex, "pid": _dead_pid(), "started": None,
              "host": socket.gethostname(), "folder": owned.identity(at), "next": None, **changes}
    fields["proof"] = owned._proof(owned._key(), fields)
    (at / owned.MARK).write_text(json.dumps(fields))
    return fields


def _leftover(out: Path, kind: str = owned.TEMPORARY, **changes) -> Path:
    """A folder a halfsafe run made beside `out` and left when it died (its process is gone)."""
    prefix = f".{out.name}.{'tmp' if kind == owned.TEMPORARY else 'old'}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    (folder / "model.safetensors").write_bytes(b"half-written")
    _mark(folder, out, kind, **changes)
    return folder


def _user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "data").mkdir()
    (path / "data" / "results.csv").write_text("1,2,3\n")
    return path


def _warnings_naming(caplog, folder: Path) -> list[str]:
    return [m for m in (r.getMessage() for r in caplog.records if r.levelname == "WARNING")
            if any(f"{folder}{end}" in m for end in (" ", ",", ")"))]


# --- beside OUT: a user's folders of a leftover's name survive ------------------------------------------------------


def _look_alikes(root: Path, out: Path) -> dict[str, Path]:
    """Every kind of folder beside `out` that is named like a leftover but that halfsafe cannot prove it made."""
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    real = _leftover(elsewhere / out.name)  # a real leftover of an OUT of the same name, in another folder
    made = {
        "no mark": _user_folder(root / f".{out.name}.tmp-mine"),
        "an old pid file": _user_folder(root / f".{out.name}.tmp-1234"),
        "a folder named OUT, OUT missing": _user_folder(root / f".{out.name}.old-backup"),
        "a forged mark": _user_folder(root / f".{out.name}.tmp-forged"),
        "a copied mark": _user_folder(root / f".{out.name}.tmp-copied"),
        "a mark under another key": _user_folder(root / f".{out.name}.old-otherkey"),
        "a mark for another OUT": _user_folder(root / f".{out.name}.tmp-otherout"),
        "a mark of the other kind": _user_folder(root / f".{out.name}.tmp-kind"),
        "a mark that is a link": _user_folder(root / f".{out.name}.tmp-linkedmark"),
        "a link to a real leftover": root / f".{out.name}.tmp-link",
        "a link to a user's folder": root / f".{out.name}.old-link",
    }
    (made["an old pid file"] / ".halfsafe-pid").write_text(str(_dead_pid()))  # the mark of halfsafe before this one
    _user_folder(made["a folder named OUT, OUT missing"] / out.name)
    forged = _mark(made["a forged mark"], out, owned.TEMPORARY)
    (made["a forged mark"] / owned.MARK).write_text(json.dumps({**forged, "proof": "0" * 64}))
    shutil.copy2(real / owned.MARK, made["a copied mark"] / owned.MARK)
    key = os.environ["HALFSAFE_CACHE"]
    os.environ["HALFSAFE_CACHE"] = str(root / "another-users-cache")
    _mark(made["a mark under another key"], out, owned.OLD)
    os.environ["HALFSAFE_CACHE"] = key
    _mark(made["a mark for another OUT"], root / "other", owned.TEMPORARY)
    _mark(made["a mark of the other kind"], out, owned.OLD)
    _mark(elsewhere, out, owned.TEMPORARY, folder=owned.identity(made["a mark that is a link"]))
    (made["a mark that is a link"] / owned.MARK).symlink_to(elsewhere / owned.MARK)
    made["a link to a real leftover"].symlink_to(real)
    made["a link to a user's folder"].symlink_to(_user_folder(root / "mine"))
    return made


def _state(folder: Path) -> tuple:
    return (os.readlink(folder), folder_hash(folder.resolve())) if folder.is_symlink() else folder_hash(folder)


def test_a_users_folders_named_like_leftovers_survive_a_convert(tiny, tmp_path, caplog):
    out = tmp_path / "out"
    made = _look_alikes(tmp_path, out)
    before = {why: _state(f) for why, f in made.items()}
    assert main(["convert", str(tiny), str(out), *SHORT]) == 0
    for why, folder in made.items():
        assert os.path.lexists(folder) and _state(folder) == before[why], why
        said = _warnings_naming(caplog, folder)
        assert len(said) == 1 and "halfsafe leaves it" in said[0], (why, said)
    assert (out / "halfsafe.json").is_file() and not (out / "thesis.tex").exists()  # the old- look-alike stayed aside


def test_a_link_named_like_a_leftover_is_never_followed(tmp_path, caplog):
    """Even to a folder that is a real, abandoned leftover of this very OUT: the link is not the folder."""
    out = tmp_path / "out"
    real = _leftover(out)
    link = tmp_path / f".out.tmp-{uuid.uuid4().hex}"
    hidden = tmp_path / "hidden"
    real.rename(hidden)
    link.symlink_to(hidden)
    before = folder_hash(hidden)
    assert clean_stale(out) == []
    assert link.is_symlink() and folder_hash(hidden) == before


# --- beside OUT: halfsafe's own leftovers are cleaned up --------------------------------------------------------------


def test_a_dead_runs_temporary_folder_is_removed(tiny, tmp_path, caplog):
    out = tmp_path / "out"
    left = _leftover(out)
    assert main(["convert", str(tiny), str(out), *SHORT]) == 0
    assert not os.path.lexists(left) and not list(tmp_path.glob(".out.*"))
    assert any("removed" in m and "did not finish" in m for m in _warnings_naming(caplog, left))


def test_a_dead_runs_old_folder_goes_back_to_out_or_away_once_the_new_one_is_in(tmp_path, caplog):
    out = tmp_path / "out"
    # killed between moving OUT aside and the new one in: it goes back
    old = _leftover(out, owned.OLD)
    _user_folder(old / out.name)
    before = folder_hash(old / out.name)
    assert clean_stale(out) == [old]
    assert folder_hash(out) == before and not os.path.lexists(old)
    # killed once the new folder was in: the old one goes
    old = _leftover(out, owned.OLD, next=owned.identity(out))
    _user_folder(old / out.name)
    assert clean_stale(out) == [old] and folder_hash(out) == before
    # OUT is another folder now (not the new one): the old one stays, and is no longer a leftover
    shutil.rmtree(out)
    _user_folder(out)
    old = _leftover(out, owned.OLD)
    _user_folder(old / out.name)
    kept = folder_hash(old / out.name)
    assert clean_stale(out) == [] and folder_hash(old / out.name) == kept
    assert any("halfsafe leaves it" in m for m in _warnings_naming(caplog, old)) and not (old / owned.MARK).exists()


def test_a_leftover_of_a_live_run_is_left_alone_but_a_reused_pid_is_no_live_run(tmp_path):
    out = tmp_path / "out"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = owned._started(sleeper.pid)
        live = _leftover(out, pid=sleeper.pid, started=started)
        reused = _leftover(out, pid=sleeper.pid, started=(started or 0) + 1)  # another process of that number
        elsewhere = _leftover(out, host=socket.gethostname() + "-other")  # cannot be checked from here
        assert clean_stale(out) == [reused]
        assert live.is_dir() and elsewhere.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()


_KILL_MID_SWAP = """
import os, sys
from pathlib import Path
import halfsafe.io.checkpoint as c
out = Path(sys.argv[1])
def killed(*a):
    os._exit(0)  # the process is gone: its old folder and its temporary one stay
with c.atomic_folder(out, replace=True) as tmp:
    (tmp / "model.safetensors").write_bytes(b"new")
    c._rename_noreplace = killed  # between moving OUT aside and the new folder in
"""


def test_a_run_that_died_mid_swap_is_undone_by_the_next_one(tmp_path, caplog):
    """A real process: its marks, its key, its pid."""
    out = _user_folder(tmp_path / "out")
    (out / "halfsafe.json").write_text("{}")
    before = folder_hash(out)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILL_MID_SWAP), str(out)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not out.exists() and len(list(tmp_path.glob(".out.old-*"))) == 1 and len(list(tmp_path.glob(".out.tmp-*"))) == 1
    assert len(clean_stale(out)) == 2
    assert folder_hash(out) == before and not list(tmp_path.glob(".out.*"))


def test_without_a_key_no_leftover_is_ever_removed(tmp_path, monkeypatch, caplog):
    """A cache folder that cannot be written: halfsafe still saves, and leaves even its own leftovers, named."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("HALFSAFE_CACHE", str(blocker / "cache"))
    out = tmp_path / "out"
    stale = Path(tempfile.mkdtemp(prefix=".out.tmp-", dir=tmp_path))
    owned.release(owned.mark(stale, out, owned.TEMPORARY))
    assert json.loads((stale / owned.MARK).read_text())["proof"] is None
    with atomic_folder(out) as tmp:
        (tmp / "x").write_text("x")
    assert (out / "x").is_file() and stale.is_dir() and len(_warnings_naming(caplog, stale)) == 1


# --- --overwrite replaces only a folder halfsafe wrote ------------------------------------------------------------


def _halfsafe_json(case: str, converted: Path, scan_json: Path, out: Path) -> None:
    mark = out / "halfsafe.json"
    if case == "empty":
        mark.write_text("")
    elif case == "{}":
        mark.write_text("{}")
    elif case == "scan --json":
        mark.write_bytes(scan_json.read_bytes())
    elif case == "a link to a record":
        mark.unlink()
        mark.symlink_to(converted / "halfsafe.json")
    elif case == "files of the wrong shape":
        d = json.loads(mark.read_text())
        mark.write_text(json.dumps({**d, "files": list(d["files"])}))
    elif case == "a folder":
        mark.unlink()
        mark.mkdir()


@pytest.mark.parametrize("case, says", [
    ("empty", "is not a record"), ("{}", "is not a record"), ("scan --json", "is not a record"),
    ("a link to a record", "has no halfsafe.json"), ("files of the wrong shape", "is not a record"),
    ("a folder", "has no halfsafe.json"),
])
def test_overwrite_refuses_a_folder_whose_halfsafe_json_is_no_record(converted, scan_json, tmp_path, capsys, case, says):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    (out / "photo.jpg").write_bytes(b"\xff\xd8")
    _halfsafe_json(case, converted, scan_json, out)
    before = folder_hash(out)
    refused(capsys, ["convert", str(converted), str(out), "--overwrite", *SHORT], "did not write", says)
    assert folder_hash(out) == before


def _hostile_addition(case: str, out: Path) -> str:
    if case == "a file of the user's":
        (out / "notes.txt").write_text("mine")
        return "holds notes.txt, which halfsafe did not write"
    if case == "a file changed":
        with open(out / "README.md", "a") as f:
            f.write("my notes\n")
        return "README.md changed since halfsafe wrote it"
    if case == "a folder of the user's":
        _user_folder(out / "mine")
        return "holds mine, which halfsafe did not write"
    if case == "an empty folder":
        (out / "empty").mkdir()
        return "holds empty, which halfsafe did not write"
    if case == "a link":
        (out / "data").symlink_to(out.parent)
        return "holds data, which halfsafe did not write"
    if case == "a link in place of a file":
        (out / "config.json").rename(out.parent / "config.json")
        (out / "config.json").symlink_to(out.parent / "config.json")
        return "holds config.json, which halfsafe did not write"
    if case == "a mark that proves nothing":
        (out / owned.MARK).write_text("{}")
        return f"holds {owned.MARK}, which halfsafe did not write"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["a file of the user's", "a file changed", "a folder of the user's", "an empty folder",
                                  "a link", "a link in place of a file", "a mark that proves nothing"])
def test_overwrite_refuses_a_folder_halfsafe_wrote_that_holds_what_it_did_not(converted, tmp_path, capsys, case):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    says = _hostile_addition(case, out)
    before = folder_hash(out)
    err = refused(capsys, ["convert", str(converted), str(out), "--overwrite", *SHORT], says, "move it out")
    assert "choose another output folder" in err and folder_hash(out) == before


def test_overwrite_refuses_a_link_as_out(converted, tmp_path, capsys):
    out = tmp_path / "out"
    out.symlink_to(shutil.copytree(converted, tmp_path / "real"))
    before = folder_hash(tmp_path / "real")
    refused(capsys, ["convert", str(converted), str(out), "--overwrite", *SHORT], "symbolic link")
    assert out.is_symlink() and folder_hash(tmp_path / "real") == before


def _listed(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_what_halfsafe_writes_lists_every_file_it_wrote(converted):
    record = report.read(converted)
    on_disk = {p.name: _listed(p) for p in converted.iterdir() if p.name != "halfsafe.json"}
    assert record.files == on_disk and list(json.loads((converted / "halfsafe.json").read_text()))[-1] == "files"
    check_out_dir(converted, overwrite=True)  # replaceable as it is


def test_overwrite_replaces_a_real_previous_output(tiny, converted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    assert main(["convert", str(tiny), str(out), "--overwrite", *SHORT]) == 0
    assert report.read(out).files and not list(tmp_path.glob(".out.*"))
    # apply: its output is replaceable too
    applied = tmp_path / "applied"
    assert main(["apply", str(out), str(tiny), str(applied), *SHORT]) == 0
    assert report.read(applied).applied is not None
    assert main(["apply", str(out), str(tiny), str(applied), "--overwrite", *SHORT]) == 0
    assert not list(tmp_path.glob(".applied.*"))


@pytest.mark.parametrize("older", ["no list", "sizes only"])
def test_an_older_halfsafe_json_is_still_a_record_but_its_folder_is_not_replaced(converted, tmp_path, capsys, older):
    """Folders written before the digests: still records (read, applied, served), but --overwrite cannot tell their
    files from ones saved over them at the same size, so it leaves them and says what to do."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    d = json.loads((out / "halfsafe.json").read_text())
    if older == "no list":
        del d["files"]
    else:
        d["files"] = {name: entry["bytes"] for name, entry in d["files"].items()}
    (out / "halfsafe.json").write_text(json.dumps(d, indent=2))
    assert report.read(out).conversion is not None  # still a record
    before = folder_hash(out)
    refused(capsys, ["convert", str(converted), str(out), "--overwrite", *SHORT], "lists no digest of each file",
            "delete it yourself", "choose another output folder")
    assert folder_hash(out) == before


def test_a_run_killed_just_after_its_rename_leaves_a_replaceable_out(converted, tmp_path):
    """Its proven mark moved into OUT with the folder (the run died before removing it): not the user's file."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    _mark(out, out, owned.TEMPORARY)
    check_out_dir(out, overwrite=True)
    (out / owned.MARK).write_text(json.dumps({**json.loads((out / owned.MARK).read_text()), "out": "other"}))
    with pytest.raises(HalfsafeError, match=f"holds {owned.MARK}, which halfsafe did not write"):
        check_out_dir(out, overwrite=True)


class _FakeExporter:
    """An exporter that writes an ONNX file's name without torch.onnx (the folder logic is what is tested here)."""

    @staticmethod
    def check_exportable(config):
        pass

    @staticmethod
    def load_fp16(folder):
        return SimpleNamespace(config=SimpleNamespace(model_type="llama"))

    @staticmethod
    def programs(model):
        yield "onnx/model_fp16.onnx", b"graph"

    @staticmethod
    def finish(folder, name=None):
        with open(folder / "config.json", "a") as f:  # as the real one edits config, tokenizer config and card
            f.write("\n")


@pytest.fixture
def fake_onnx(monkeypatch):
    import halfsafe.export.onnx as onnx

    def save(program, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(program)

    monkeypatch.setattr(onnx, "require_onnx", lambda: None)
    monkeypatch.setattr(onnx, "exporter_for_folder", lambda folder: _FakeExporter)
    monkeypatch.setattr(onnx, "rewrite_for", lambda profile, model, folder: ({}, 0))
    monkeypatch.setattr(onnx, "save_program", save)
    monkeypatch.setattr(onnx, "split_graph", lambda profile, program, counts=None: None)  # its graph is a name
    monkeypatch.setattr(onnx, "report_for", lambda path, *a, **k: SimpleNamespace(
        path=str(path), norm_prescales={}, file_bytes=0, clip_nodes=0, runtime=None, to_dict=dict))


def test_overwrite_replaces_an_onnx_export_halfsafe_wrote(converted, tmp_path, capsys, fake_onnx):
    out = tmp_path / "web"
    assert main(["export", "onnx", str(converted), str(out)]) == 0
    record = report.read(out)
    assert "onnx/model_fp16.onnx" in record.files and "model.safetensors" not in record.files
    assert record.files["config.json"] == _listed(out / "config.json")  # after the exporter's edit
    assert record.fingerprint is None  # no weights here: the source's fingerprint is not carried over
    assert main(["export", "onnx", str(converted), str(out), "--overwrite"]) == 0
    (out / "onnx" / "notes.txt").write_text("mine")
    refused(capsys, ["export", "onnx", str(converted), str(out), "--overwrite"], "holds onnx/notes.txt")


def test_overwrite_replaces_a_convert_to_onnx_output(tiny, tmp_path, fake_onnx):
    out = tmp_path / "out"
    assert main(["convert", str(tiny), str(out), "--to", "onnx", *SHORT]) == 0
    record = report.read(out)
    assert "onnx/model_fp16.onnx" in record.files and "model.safetensors" in record.files
    assert record.files["config.json"] == _listed(out / "config.json")
    assert verified_record(out)["fingerprint"] == record.fingerprint  # config.json fingerprinted after the exporter's edit
    assert main(["convert", str(tiny), str(out), "--to", "onnx", "--overwrite", *SHORT]) == 0


# --- --overwrite by content: before the long part, and again right before the swap -----------------------------------


def _finetune_saved_over(out: Path) -> None:
    """What a user does with a converted folder: load it, train, save_pretrained into it. Every file keeps its size."""
    import torch
    from transformers import AutoModelForCausalLM

    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(out)
    assert {p.name: p.stat().st_size for p in out.iterdir()} == sizes  # a size alone cannot tell


def _overwrite_argv(command: str, converted: Path, tiny: Path, out: Path) -> list[str]:
    return {"convert": ["convert", str(tiny), str(out), *SHORT],
            "apply": ["apply", str(converted), str(tiny), str(out), *SHORT],
            "finetune": ["finetune", str(tiny), str(out), *SHORT, "--steps", "1"],
            "export onnx": ["export", "onnx", str(converted), str(out)]}[command] + ["--overwrite"]


@pytest.mark.parametrize("command", ["convert", "apply", "finetune", "export onnx"])
def test_overwrite_keeps_a_fine_tune_saved_over_out(tiny, converted, tmp_path, capsys, monkeypatch, command):
    """Every command that takes --overwrite: a folder halfsafe wrote, whose weights a fine-tune replaced at the same
    size, is named and kept, before anything loads."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    _finetune_saved_over(out)
    before = folder_hash(out)
    monkeypatch.setattr("halfsafe.io.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    refused(capsys, _overwrite_argv(command, converted, tiny, out), "model.safetensors changed since halfsafe wrote it",
            "move it out")
    assert folder_hash(out) == before and not list(tmp_path.glob(".out.*"))


def test_the_demos_convert_keeps_a_fine_tune_saved_over_its_out(converted, tmp_path, monkeypatch):
    """`halfsafe demo --out OUT` replaces OUT through convert_checkpoint(overwrite=True): the same check."""
    from halfsafe.convert import convert_checkpoint

    out = tmp_path / "out"
    shutil.copytree(converted, out)
    _finetune_saved_over(out)
    before = folder_hash(out)
    monkeypatch.setattr("halfsafe.io.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(HalfsafeError, match="model.safetensors changed since halfsafe wrote it"):
        convert_checkpoint(str(converted), str(out), overwrite=True, progress=False)
    assert folder_hash(out) == before


def _during_the_run(case: str, out: Path) -> str:
    """What a user (or another program) does to OUT while a run that replaces it works; what the refusal names."""
    if case == "a file written":
        (out / "notes.txt").write_text("written while halfsafe worked")
        return "holds notes.txt, which halfsafe did not write"
    if case == "a folder written":
        _user_folder(out / "runs")
        return "holds runs, which halfsafe did not write"
    if case == "a fine-tune saved over it":
        _finetune_saved_over(out)
        return "model.safetensors changed since halfsafe wrote it"
    if case == "a listed file edited in place":
        with open(out / "config.json", "r+b") as f:
            f.write(b" ")  # the same size: its digest alone tells
        return "config.json changed since halfsafe wrote it"
    if case == "edited, its time set back":
        st = os.stat(out / "config.json")
        with open(out / "config.json", "r+b") as f:
            f.write(b" ")
        os.utime(out / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns))  # only its ctime tells it was written
        return "config.json changed since halfsafe wrote it"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["a file written", "a folder written", "a fine-tune saved over it",
                                  "a listed file edited in place", "edited, its time set back"])
def test_what_is_written_into_out_while_a_run_works_is_kept(tiny, converted, tmp_path, case):
    """A real convert --overwrite: its `finish` (the seam `convert --to onnx` adds its graphs through, called in the
    temporary folder once the checkpoint is written, before the swap) changes OUT. The swap moves OUT aside, finds it
    is not what was recorded, puts it back as it is and fails in one line; the new checkpoint is not kept."""
    from halfsafe.convert import run_convert
    from halfsafe.requests import ConvertRequest, TextOptions

    out = tmp_path / "out"
    shutil.copytree(converted, out)
    folder, said = os.stat(out).st_ino, []
    request = ConvertRequest(tiny, out, TextOptions(seq_len=32, max_samples=1), overwrite=True, progress=False)
    seen = {}

    def finish(tmp: Path) -> None:
        said.append(_during_the_run(case, out))
        seen["out"] = folder_hash(out)

    with pytest.raises(HalfsafeError) as e:
        run_convert(request, finish)
    assert said[0] in str(e.value) and "move it out" in str(e.value) and "this run saved nothing" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    assert folder_hash(out) == seen["out"] and os.stat(out).st_ino == folder  # the folder as the user left it
    assert not list(tmp_path.glob(".out.*"))


def test_an_unchanged_out_is_read_once_a_run(tiny, converted, tmp_path, monkeypatch):
    """The check before the long part hashes each file of OUT; the checks after it (the disk check, the save's, the
    swap's) find each file as it was hashed (device, inode, size, mtime, ctime) and do not read it again."""
    import hashlib as real

    import halfsafe.io.checkpoint as checkpoint

    out = tmp_path / "out"
    shutil.copytree(converted, out)
    hashed = []

    def sha256(*args):
        hashed.append(1)
        return real.sha256(*args)

    monkeypatch.setattr(checkpoint, "hashlib", SimpleNamespace(sha256=sha256))
    assert main(["convert", str(tiny), str(out), "--overwrite", *SHORT]) == 0
    assert len(hashed) == len(report.read(converted).files)  # each of the old OUT's files, once


@PROPERTY
@given(data=st.data())
def test_any_byte_changed_in_any_listed_file_keeps_out(converted, data):
    """One byte of any file halfsafe listed, anywhere in it, changed in place (its size as it was): --overwrite
    refuses OUT, naming that file, and leaves it as it is."""
    names = sorted(report.read(converted).files)
    name = data.draw(st.sampled_from(names))
    with tempfile.TemporaryDirectory() as root:
        out = shutil.copytree(converted, Path(root) / "out")
        size = (out / name).stat().st_size
        at, flip = data.draw(st.integers(0, size - 1)), data.draw(st.integers(1, 255))
        check_out_dir(out, overwrite=True)  # as it was: replaceable (and each file hashed, as before a real run)
        with open(out / name, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ flip]))
        before = folder_hash(out)
        with pytest.raises(HalfsafeError, match=f"{name} changed since halfsafe wrote it"):
            check_out_dir(out, overwrite=True)
        assert folder_hash(out) == before and (out / name).stat().st_size == size


# --- this process's own leftovers ---------------------------------------------------------------------------------


def test_a_leftover_of_this_very_process_is_removed_once_its_run_is_over(tmp_path):
    """A folder this process marked is in use while its run is active (another block of this process may be writing
    it: kept), and a leftover once the run is released (a block that could not clean up: removed), though its pid is
    this live process's own."""
    out = tmp_path / "out"
    folder = Path(tempfile.mkdtemp(prefix=".out.tmp-", dir=tmp_path))
    run = owned.mark(folder, out, owned.TEMPORARY)
    m = owned.owned(folder, out, owned.TEMPORARY)
    assert m["pid"] == os.getpid() and m["started"] == owned._started(os.getpid())  # this live process
    try:
        assert owned.running(m) and clean_stale(out) == [] and folder.is_dir()
    finally:
        owned.release(run)
    assert not owned.running(m)
    assert clean_stale(out) == [folder] and not os.path.lexists(folder)


# --- the fine-tune's partial folder -------------------------------------------------------------------------------


@pytest.mark.parametrize("restart", [[], ["--restart"]])
def test_finetune_refuses_a_partial_folder_it_did_not_make(tiny, tmp_path, capsys, restart):
    out = tmp_path / "out"
    mine = _user_folder(tmp_path / ".out.partial")
    (mine / "finetune_state.pt").write_bytes(b"my own state")
    before = folder_hash(mine)
    refused(capsys, ["finetune", str(tiny), str(out), *SHORT, *restart], ".out.partial", "did not make it", "move it aside")
    assert folder_hash(mine) == before and not out.exists()


def test_the_partial_folder_halfsafe_made_is_reused_and_removed(tmp_path):
    from halfsafe.training.finetune import _check_partial, _make_partial, _remove_partial, partial_dir

    out = tmp_path / "out"
    _make_partial(out)
    folder = partial_dir(out)
    _make_partial(out)  # there already: reused
    _check_partial(out)
    shutil.copytree(folder, tmp_path / "copy")
    _remove_partial(out)
    assert not folder.exists()
    (tmp_path / "copy").rename(folder)  # its mark copied with it: names another folder
    with pytest.raises(HalfsafeError, match="did not make it"):
        _check_partial(out)
    _remove_partial(out)
    assert folder.is_dir()


# --- properties ---------------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
SUFFIX = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), max_size=24).filter(
    lambda s: len(s.encode()) < 200)


@st.composite
def mark_contents(draw, folder: Path, out: Path, kind: str) -> bytes:
    """What a mark file may hold: any bytes, any JSON, a mark's fields with any values, or a real mark of this
    folder with one field changed (before or after it is signed)."""
    how = draw(st.sampled_from(["bytes", "json", "fields", "changed", "changed", "changed and signed", "changed and signed"]))
    if how == "bytes":
        return draw(st.binary(max_size=80))
    if how == "json":
        return json.dumps(draw(JSON)).encode()
    if how == "fields":
        return json.dumps({k: draw(JSON) for k in owned._FIELDS}).encode()
    real = {"halfsafe": kind, "out": out.name, "run": uuid.uuid4().hex, "pid": _dead_pid(), "started": None,
            "host": socket.gethostname(), "folder": owned.identity(folder), "next": None}
    key = draw(st.sampled_from(["halfsafe", "out", "folder"] if how == "changed and signed" else list(real)))
    value = draw(JSON.filter(lambda v: v != real[key]))
    if how == "changed and signed":
        real[key] = value
        return json.dumps({**real, "proof": owned._proof(owned._key(), real)}).encode()
    signed = {**real, "proof": owned._proof(owned._key(), real)}
    return json.dumps({**signed, key: value}).encode()


@settings(PROPERTY, max_examples=40)
@given(data=st.data(), old=st.booleans(), suffix=SUFFIX, holds_out=st.booleans())
def test_no_folder_without_a_valid_mark_is_ever_removed(data, old, suffix, holds_out):
    with tempfile.TemporaryDirectory() as root:
        out = Path(root) / "out"
        folder = _user_folder(Path(root) / f".out.{'old' if old else 'tmp'}-{suffix}")
        if holds_out:
            _user_folder(folder / "out")
        kind = owned.OLD if old else owned.TEMPORARY
        (folder / owned.MARK).write_bytes(data.draw(mark_contents(folder, out, kind)))
        before = folder_hash(Path(root))
        assert clean_stale(out) == []
        assert folder_hash(Path(root)) == before


@st.composite
def halfsafe_jsons(draw, record: dict) -> bytes:
    """Any bytes, any JSON, or a real record with a key dropped or given any value."""
    how = draw(st.sampled_from(["bytes", "json", "drop", "change"]))
    if how == "bytes":
        return draw(st.binary(max_size=80))
    if how == "json":
        return json.dumps(draw(JSON)).encode()
    key = draw(st.sampled_from(sorted(record)))
    if how == "drop":
        return json.dumps({k: v for k, v in record.items() if k != key}).encode()
    return json.dumps({**record, key: draw(JSON)}).encode()


@PROPERTY
@given(data=st.data())
def test_no_halfsafe_json_but_a_record_makes_a_folder_replaceable(converted, data):
    record = json.loads((converted / "halfsafe.json").read_text())
    text = data.draw(halfsafe_jsons(record))
    with tempfile.TemporaryDirectory() as root:
        out = shutil.copytree(converted, Path(root) / "out")
        (out / "halfsafe.json").write_bytes(text)
        before = folder_hash(out)
        try:
            check_out_dir(out, overwrite=True)
        except HalfsafeError as e:
            assert len(str(e).splitlines()) == 1
        else:
            Record.from_dict(json.loads(text))  # replaceable: then it is a record
        assert folder_hash(out) == before
