"""Output that survives faults: an unwritable or read-only destination, a full disk, and a run killed (SIGKILL)
during calibration, while saving, and between moving an old checkpoint aside and the new one in. Whatever
happens, OUT is either absent, the old checkpoint, or the complete new one; leftovers are cleaned up by the
next run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hostile import SHORT, copy_of, folder_hash, refused
from tiny import save_tiny

from halfsafe.cli import main

CONVERT = ["--seq-len", "32", "--max-samples", "1"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("src") / "tiny")


def _leftovers(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*"))


def test_unwritable_destination_fails_before_any_work(src, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out, why in ((blocker / "out", "not a folder"), (Path("/proc/halfsafe-test") / "out", "cannot write")):
        assert main(["convert", str(src), str(out), *CONVERT]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_disk_too_small_is_refused_before_the_slow_part(src, tmp_path, capsys, monkeypatch):
    import halfsafe.io.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr("halfsafe.convert.make_fp16_safe", lambda *a, **k: pytest.fail("the slow part ran"))
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), *CONVERT]) == 2
    assert "GB free" in capsys.readouterr().err and not out.exists() and not _leftovers(out)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, really full-able (skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_during_the_save_is_a_one_line_error_and_leaves_nothing(src, small_disk, capsys, monkeypatch):
    import halfsafe.io.checkpoint as checkpoint

    # fill the disk but for a little, and let the space check pass: the writes themselves must fail cleanly
    (small_disk / "filler").write_bytes(b"\0" * ((4 << 20) - (96 << 10)))  # 96 KiB left; the checkpoint is ~230 KB
    monkeypatch.setattr(checkpoint, "output_bytes", lambda model: 1)
    out = small_disk / "out"
    assert main(["convert", str(src), str(out), *CONVERT]) == 2
    err = capsys.readouterr().err
    assert "could not write" in err and "No space left" in err and "Traceback" not in err, err
    assert not out.exists() and not _leftovers(out)


def test_read_only_folder(src, small_disk, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    out = small_disk / "out"
    assert main(["convert", str(src), str(out), *CONVERT]) == 2
    assert "cannot write" in capsys.readouterr().err and not out.exists()


# --- killed runs ------------------------------------------------------------------------------------------------

KILL_AT = {
    # during calibration: the first activation scan
    "calibration": """
        import halfsafe.convert as c
        def scan_with(*a, **k):
            kill()
        c.scan_with = scan_with
    """,
    # during the save: after the weights are written, before halfsafe.json and the rename
    "save": """
        import halfsafe.engine.write as c
        real = c.write_weights
        def write_weights(*a, **k):
            bad = real(*a, **k)
            kill()
        c.write_weights = write_weights
    """,
    # with --overwrite: after the old checkpoint was moved aside, before the new one is moved in
    "swap": """
        import pathlib
        real = pathlib.Path.rename
        def rename(self, target):
            result = real(self, target)
            if ".old-" in str(target):
                kill()
            return result
        pathlib.Path.rename = rename
    """,
}


def _killed_convert(src: Path, out: Path, point: str, *extra: str) -> int:
    code = textwrap.dedent("""
        import os, signal, sys
        def kill():
            os.kill(os.getpid(), signal.SIGKILL)
    """) + textwrap.dedent(KILL_AT[point]) + textwrap.dedent(f"""
        from halfsafe.cli import main
        sys.exit(main({["convert", str(src), str(out), *CONVERT, *extra]!r}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=600).returncode


@pytest.mark.parametrize("point", ["calibration", "save"])
def test_a_killed_run_leaves_no_output_and_the_next_run_cleans_up(src, tmp_path, point, caplog):
    out = tmp_path / "out"
    assert _killed_convert(src, out, point) == -9
    assert not out.exists()
    if point == "save":
        assert _leftovers(out), "the killed save should have left its temporary folder"
    assert main(["convert", str(src), str(out), *CONVERT]) == 0
    assert (out / "halfsafe.json").is_file() and not _leftovers(out)
    if point == "save":
        assert "did not finish" in caplog.text


@pytest.mark.parametrize("point", ["save", "swap"])
def test_overwrite_keeps_the_old_checkpoint_until_the_new_one_is_complete(src, tmp_path, point):
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), *CONVERT]) == 0
    before, folder = folder_hash(out), os.stat(out).st_ino  # (a file added to it would make --overwrite refuse it)
    assert _killed_convert(src, out, point, "--overwrite") == -9
    # killed mid-swap the old folder sits aside; the next run (or this check) must find a complete checkpoint
    if not out.exists():
        assert point == "swap"
        assert main(["convert", str(src), str(tmp_path / "elsewhere"), *CONVERT]) == 0  # unrelated: nothing changes
        from halfsafe.io.checkpoint import clean_stale

        clean_stale(out)
    assert folder_hash(out) == before and os.stat(out).st_ino == folder  # the old checkpoint, intact
    assert json.loads((out / "halfsafe.json").read_text())["plan"]
    assert main(["convert", str(src), str(out), *CONVERT, "--overwrite"]) == 0
    assert os.stat(out).st_ino != folder and not _leftovers(out)


# --- --overwrite replaces only halfsafe's own output, and never a folder that appeared meanwhile --------------------


@pytest.fixture
def model(src, tmp_path):
    return copy_of(src, tmp_path / "model")


def test_overwrite_replaces_only_a_folder_halfsafe_wrote_or_an_empty_one(model, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "photo.jpg").write_bytes(b"\xff\xd8")
    refused(capsys, ["convert", str(model), str(mine), "--overwrite", *SHORT], "did not write", "halfsafe.json")
    assert (mine / "photo.jpg").read_bytes() == b"\xff\xd8"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(model), str(empty), "--overwrite", *SHORT]) == 0  # an empty folder
    assert main(["convert", str(model), str(empty), "--overwrite", *SHORT]) == 0  # a folder halfsafe wrote
    assert (empty / "halfsafe.json").is_file() and not list(tmp_path.glob(".empty.*"))


def _convert_while_paused(model: Path, out: Path, meanwhile, mine: list[str], monkeypatch) -> tuple[int, str]:
    """This run converts MODEL into OUT; right after its save-time checks (while it writes) `meanwhile()` puts another
    folder at OUT. Returns this run's exit code and the hash of that folder."""
    import halfsafe.io.checkpoint as checkpoint

    real, seen = checkpoint._write_extras, {}

    def write_extras(*args, **kwargs):
        meanwhile()
        seen["other"] = folder_hash(out)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_write_extras", write_extras)
    return main(["convert", str(model), str(out), *SHORT, *mine]), seen["other"]


def test_two_converts_to_one_out_the_second_to_finish_fails_and_the_first_stays(model, tmp_path, capsys, monkeypatch):
    """Two real processes: the other one finishes while this one writes (its clean-up must spare this one's
    temporary folder, and this one's rename must not replace its output)."""
    out = tmp_path / "out"

    def other_run():
        done = subprocess.run([sys.executable, "-m", "halfsafe.cli", "convert", str(model), str(out), *SHORT],
                              capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        assert done.returncode == 0, done.stderr

    capsys.readouterr()
    code, other = _convert_while_paused(model, out, other_run, [], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "appeared while this run was writing it" in err[0], err
    assert folder_hash(out) == other and (out / "halfsafe.json").is_file()  # the first to finish: intact
    assert not list(tmp_path.glob(".out.*"))


def test_overwrite_replaces_only_the_folder_that_was_there_when_the_save_began(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["convert", str(model), str(out), *SHORT]) == 0
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "halfsafe.json").write_text("{}")

    def replaced_meanwhile():  # as another --overwrite run's swap would: the old folder out, a new one in
        out.rename(tmp_path / "older")
        newer.rename(out)

    capsys.readouterr()
    code, other = _convert_while_paused(model, out, replaced_meanwhile, ["--overwrite"], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "appeared while this run was writing it" in err[0], err
    assert folder_hash(out) == other and not list(tmp_path.glob(".out.*"))
