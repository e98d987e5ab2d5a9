"""scripts/setup makes .venv with what its caller needs: the fixture's extras for scripts/demo (the default), the
test extras for scripts/test, which include the fixture's; each set-up once (a stamp), announced on stderr. Run
with HALFSAFE_VENV at a folder whose bin/python is a stand-in that logs its calls, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup"


@pytest.fixture
def setup(tmp_path):
    """run(*args) -> (exit code, stderr, the stand-in python's pip installs)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!{shutil.which("bash")}\necho "$*" >> {log}\n')  # torch imports, pip answers: all succeed
    python.chmod(0o755)

    def run(*args: str):
        before = log.read_text().splitlines() if log.exists() else []
        done = subprocess.run([shutil.which("bash"), str(SETUP), *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HALFSAFE_VENV": str(venv)})
        calls = (log.read_text().splitlines() if log.exists() else [])[len(before):]
        return done.returncode, done.stderr, [c for c in calls if c.startswith("-m pip install") and "-e" in c.split()]

    return run


def test_the_demo_gets_the_fixture_extras_and_the_tests_add_theirs_once(setup):
    code, err, installs = setup()
    assert code == 0 and len(installs) == 1 and installs[0].endswith("-e .[fixture]"), installs
    assert "with its [fixture] extras" in err and "into " in err
    assert setup() == (0, "", [])  # made once
    code, err, installs = setup("test")
    assert code == 0 and len(installs) == 1 and installs[0].endswith("-e .[test]") and "[test] extras" in err
    assert setup("test") == (0, "", []) and setup() == (0, "", [])  # the test extras include the fixture's


def test_unknown_extras_are_refused_in_one_line(setup):
    code, err, installs = setup("everything")
    assert code == 2 and err.strip().count("\n") == 0 and "fixture or test" in err and installs == []
