"""What the benchmarks share: where things are, the import paths, the offline hub, the log line and the commit a result
comes from. Standard library only: the scripts that run themselves again in vLLM's Python import it there too.

Every script under bench/GROUP/ starts with

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
    from common import ROOT, RESULTS  # noqa: E402

Importing it puts the group folders on sys.path after everything else (a script imports another one by its module
name, wherever it lives, and never shadows tests/ or an installed package: tests/webgpu.py and
bench/runtimes/webgpu.py share a name), and sets HF_HUB_OFFLINE=1 unless it is set: nothing here downloads.
`python bench/list.py` lists the scripts, group by group, with what each writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
# what each folder of bench/ measures, in the order `python bench/list.py` prints them
GROUPS = {
    "fidelity": "how close the converted model is to float32: KL, top-1, greedy tokens, activation peaks",
    "runtimes": "the converted model in each runtime and its profile: ONNX, transformers.js, WebGPU, llama.cpp, vLLM",
    "cost": "what the commands cost: time, CPU-seconds and memory, on this CPU, under a memory cap, on a GPU",
    "training": "fine-tuning and RL in float16: loss curves, GRPO with vLLM rollouts",
    "tools": "what the other benchmarks use or compare with: synthetic checkpoints, memory caps, version diffs",
}


def groups_on_path() -> None:
    """Every group folder on sys.path, after everything else (a script imports another by its module name)."""
    for group in GROUPS:
        if str(BENCH / group) not in sys.path:
            sys.path.append(str(BENCH / group))


groups_on_path()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

T0 = time.perf_counter()


def add_paths(*folders: str) -> None:
    """Put ROOT/folder first on sys.path for each folder (the last named ends up first): "tests" for tests/tiny,
    tests/stress.py and the runtime set-ups the tests use, "src" for this checkout's halfsafe."""
    for folder in folders:
        sys.path.insert(0, str(ROOT / folder))


def log(msg: str) -> None:
    """A progress line with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def git_commit() -> str:
    """The commit the numbers come from, marked "+dirty" when the work tree differs from it."""

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
