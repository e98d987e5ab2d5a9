"""Helpers for tests on hostile input: a folder's hash, a one-line refusal, a fresh copy of a tiny checkpoint, plans
for it as halfsafe writes them, and a call that must not block on a FIFO."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from tiny import make_tiny

from halfsafe.cli import main
from halfsafe.core.groups import expand
from halfsafe.core.plan import Plan
from halfsafe.families import family_for

SHORT = ["--seq-len", "32", "--max-samples", "1"]


def folder_hash(folder: Path) -> str:
    """Every entry under `folder`: its path, its link target or its bytes."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_symlink():
            h.update(b"-> " + os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def refused(capsys, argv: list[str], *says: str) -> str:
    """`halfsafe ARGV` exits 2 with one line on stderr (no traceback) that says each of `says`."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


def copy_of(folder: Path, dest: Path) -> Path:
    """A fresh copy of a checkpoint folder, to be made hostile."""
    dest.mkdir(parents=True)
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def tiny_plan(residual: int = -1) -> dict:
    """A plan for tiny "llama" (seed 0) with this residual exponent and the tensor list that goes with it, as
    halfsafe writes it (whether or not halfsafe would choose it)."""
    m = make_tiny("llama")
    family = family_for("llama")
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    return Plan.build(family.name, "llama", expand(family, m), {"residual": residual}, 2.0, None, shapes).to_dict()


def returns_within(call, fifos: list[Path], seconds: float = 60):
    """`call()`'s value, run on a thread; fails the test where it has not returned within `seconds` (a read blocked on
    a FIFO: the FIFOs are then opened for writing and closed, so the blocked reader sees an end and the thread ends)."""
    result = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001 (reported below, on the test's thread)
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader waiting on it: it reads an end now
            except OSError:
                pass
        thread.join(30)
        pytest.fail(f"blocked on a FIFO for {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]
