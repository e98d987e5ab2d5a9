"""scripts/install-chromium (called by scripts/setup): Debian's chromium installed when missing, as root with
apt-get, tried once, never failing the set-up. Run with a PATH of stand-ins (id, apt-get, chromium) that log
their calls, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install-chromium"


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path):
    """run(uid=0, apt_fails=False, chromium=False) -> (exit code, stderr, apt-get calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "mkdir", "touch", "dirname"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    log = tmp_path / "apt.log"
    stamp = tmp_path / "venv" / ".halfsafe-chromium-tried"

    def run(uid: int = 0, apt_fails: bool = False, chromium: bool = False):
        _stand_in(bin_dir, "id", f"echo {uid}")
        _stand_in(bin_dir, "apt-get", f'echo "$*" >> {log}; exit {100 if apt_fails else 0}')
        if chromium:
            _stand_in(bin_dir, "chromium", "exit 0")
        before = log.read_text().splitlines() if log.exists() else []
        done = subprocess.run([shutil.which("bash"), str(SCRIPT), str(stamp)], env={"PATH": str(bin_dir)},
                              capture_output=True, text=True, timeout=30)
        after = log.read_text().splitlines() if log.exists() else []
        return done.returncode, done.stderr, after[len(before):]

    return run, stamp


def test_installs_once_as_root(machine):
    run, stamp = machine
    code, err, calls = run()
    assert code == 0 and calls == ["update -qq", "install -y -qq chromium"] and "installing chromium" in err
    assert stamp.is_file()
    assert run()[2] == []  # tried once


def test_apt_failure_does_not_fail_the_setup(machine):
    run, stamp = machine
    code, err, calls = run(apt_fails=True)
    assert code == 0 and calls == ["update -qq"] and "web page test will skip" in err and stamp.is_file()


@pytest.mark.parametrize("case", [{"uid": 1000}, {"chromium": True}])
def test_nothing_to_do(machine, case):
    run, stamp = machine
    assert run(**case) == (0, "", []) and not stamp.exists()
