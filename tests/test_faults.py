"""Output that survives faults: an unwritable or read-only destination, a full disk, and a run killed (SIGKILL)
during calibration, while saving, and between moving an old checkpoint aside and the new one in. Whatever
happens, OUT is either absent, the old checkpoint, or the complete new one; leftovers are cleaned up by the
next run."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
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
        import halfsafe.convert.calibrate as c
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



# --- the write's thread fails: the caller gets the error, and never waits for a staging block that never comes back --

_FILE_OUT_WRITER = """
import importlib.util, json, os, resource, signal, sys
source, out, block, blocks, tail, limit = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
spec = importlib.util.spec_from_file_location("file_out", source)  # the module alone: stdlib only, no torch to load
file_out = importlib.util.module_from_spec(spec)
spec.loader.exec_module(file_out)
if limit:  # a file may grow to `limit` bytes, then every write fails (EFBIG) as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
step, f = None, None
try:
    with file_out.FileOut(out, block=block) as f:
        for step in range(blocks):
            f.write(os.urandom(block))
        if tail:
            step = "tail"
            f.write(os.urandom(tail))
        step = "close"
        f.close()
    print(json.dumps({"raised_at": None}))
except OSError as e:
    print(json.dumps({"raised_at": step, "errno": e.errno, "thread_alive": f is not None and f._thread.is_alive()}))
"""

BLOCKS = 5
# where the write fails: (the block that fails, counted from 0, the last being the tail; the tail's bytes)
FAIL_AT = {"first": (0, 100), "second": (1, 100), "middle": (2, 100), "second to last": (BLOCKS - 2, 100),
           "last whole block": (BLOCKS - 1, 0), "the tail": (BLOCKS, None)}


HANG = 300  # seconds: how long a hung caller is waited for (a deadlock guard, never a measure of speed)


def _writer(out: Path, block: int, tail: int, limit: int = 0, meanwhile=lambda child: None) -> tuple[dict, list]:
    """FileOut writing BLOCKS blocks of `block` bytes, then `tail` bytes, into `out`, in a process of its own (what
    it raised, and where), while `meanwhile(child)` runs here; a caller still waiting after HANG s fails the test."""
    from halfsafe.engine import file_out

    args = [file_out.__file__, str(out), block, BLOCKS, tail, limit]
    child = subprocess.Popen([sys.executable, "-c", _FILE_OUT_WRITER, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    try:
        meanwhile(child)
        stdout, stderr = child.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"the caller hung: still waiting after {HANG} s (for a staging block the failed write kept?)")
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, stderr
    return json.loads(stdout), [*range(BLOCKS), *(["tail"] if tail else []), "close"]


@pytest.mark.parametrize("disk", ["tmpfs", "file size limit"])
@pytest.mark.parametrize("where", sorted(FAIL_AT))
def test_a_full_disk_under_the_writes_thread_reaches_the_caller_whichever_block_fails(tmp_path, request, disk, where):
    """engine.file_out: the thread's write of block k fails for real one page into the block (a full tmpfs: ENOSPC;
    past RLIMIT_FSIZE, which needs no mount: EFBIG). The caller, writing a block at a time, gets that error from the
    write of block k+1 or k+2 (two staging blocks: it is at most one block ahead) or from close, never hangs, and
    the thread is done."""
    block = 2 * 4096
    k, tail = FAIL_AT[where]
    tail = 4096 + 100 if tail is None else tail  # the tail (written by close) fails one page in too
    room = k * block + 4096
    if disk == "tmpfs":
        folder = request.getfixturevalue("small_disk")
        (folder / "filler").write_bytes(b"\0" * ((4 << 20) - room))
        fs = os.statvfs(folder)
        assert fs.f_bavail * fs.f_frsize == room
        limit, full = 0, errno.ENOSPC
    else:
        folder, limit, full = tmp_path, room, errno.EFBIG
    got, steps = _writer(folder / "out.bin", block, tail, limit)
    assert got["raised_at"] is not None, f"the failed write of block {k} was never raised in the caller"
    assert got["errno"] == full and not got["thread_alive"]
    at = steps.index(got["raised_at"])
    assert k < at <= min(k + 2, len(steps) - 1), f"block {k} failed; raised by {got['raised_at']}"


@pytest.mark.parametrize("where", sorted(FAIL_AT))
def test_a_write_failing_while_the_caller_waits_for_a_staging_block_is_raised_not_hung(tmp_path, where):
    """The order that hangs a caller if a failed write keeps its staging block: block k's write is under way when
    the caller, with block k+1 staged, waits for a free block (or, past the last block, in close). The file is a
    FIFO read here: blocks 0..k-1 are read, block k's write fills the pipe and waits; once the caller's thread sleeps,
    the reader is closed and block k's write fails (EPIPE). The caller must get the error from exactly the next
    step that can raise (the write of block k+2, the tail, or close)."""
    import fcntl
    import select

    block = 256 << 10
    k, tail = FAIL_AT[where]
    tail = block - 4096 + 100 if tail is None else tail
    fifo = tmp_path / "out.bin"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # no wait for the writer; no EOF reported before it comes
    room = fcntl.fcntl(reader, getattr(fcntl, "F_GETPIPE_SZ", 1032))
    assert room < block // 2 and (k < BLOCKS or tail > room), "the failing block must fill the pipe"

    def wait_readable():
        assert select.select([reader], [], [], HANG)[0], f"the writer wrote nothing for {HANG} s"

    def fail_block_k_while_the_caller_waits(child):
        left = k * block
        while left:
            wait_readable()
            got = os.read(reader, min(left, 1 << 16))
            assert got, "the writer closed the file early"
            left -= len(got)
        wait_readable()  # block k's bytes: its write is under way, held by the full pipe
        stat = Path(f"/proc/{child.pid}/task/{child.pid}/stat")
        for _ in range(HANG * 1000):  # until the caller's thread sleeps: waiting for a staging block, or in close
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "S":
                break
            time.sleep(0.001)
        else:
            pytest.fail("the caller never waited")
        os.close(reader)
        open_.clear()

    open_ = [reader]
    try:
        got, steps = _writer(fifo, block, tail, meanwhile=fail_block_k_while_the_caller_waits)
    finally:
        for fd in open_:
            os.close(fd)
    assert got["raised_at"] == steps[min(k + 2, len(steps) - 1)] and got["errno"] == errno.EPIPE, got
    assert not got["thread_alive"]
