"""The runtimes made by scripts/setup-* (vLLM, llama.cpp): each script prints the folder it made on its last stdout line,
or explains on stderr why it could not and exits 0; the tests skip with that line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def made_by(script: Path, spec: str, needs: str, timeout: float, env: dict | None = None) -> tuple[Path | None, str]:
    """(the folder `script` made, "") once it holds `needs`, or (None, why not: a skip reason)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return None, f"{spec} is tested on x86-64 Linux only"
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=timeout, env=env)
    printed = done.stdout.strip()
    folder = Path(printed.splitlines()[-1]) if printed else None
    if done.returncode != 0 or folder is None or not (folder / needs).is_file():
        return None, (done.stderr.strip().splitlines() or [f"scripts/{script.name} made no environment"])[-1]
    return folder, ""
