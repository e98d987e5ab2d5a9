#!/usr/bin/env python
"""The README's scan/convert cost table: wall time and peak RSS of the real commands on the Gemma 3 270M fixture.

    .venv/bin/python bench/cost.py            # writes bench/results/cost.{json,md}

Each command runs in its own process; peak RSS is the child's maximum resident set (getrusage), wall time is
measured around it. The load average before each run is recorded: on a shared machine times are upper bounds.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from run_benchmarks import RESULTS, run_info  # noqa: E402

FP32_BYTES = 268_098_176 * 4  # Gemma 3 270M parameters x 4 bytes: the fp32 model the ratios refer to


def measure(args: list[str]) -> dict:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "halfsafe.cli", *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    if proc.returncode != 0:
        raise SystemExit(f"halfsafe {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return {"command": "halfsafe " + " ".join(args), "wall_s": round(wall, 1), "peak_rss_bytes": rss,
            "rss_vs_fp32": round(rss / FP32_BYTES, 2), "load_average_before": load,
            "rss_is_lower_bound_of_earlier_child": rss == before * 1024}


def main() -> int:
    from halfsafe.fixtures import gemma3_270m_folder

    gemma3_270m_folder()  # build the fixture first, outside the measurements
    run = run_info()
    tmp = Path(tempfile.mkdtemp(prefix="halfsafe-cost-"))
    try:
        # one command per process: ru_maxrss of RUSAGE_CHILDREN is the largest child so far, so the scan runs first
        rows = [measure(["scan", "gemma3-270m", "--fp16-check"])]
        rows.append(measure(["convert", "gemma3-270m", str(tmp / "out")]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    md = ["| command | wall time | peak RSS | vs the 1.07 GB fp32 model | load average before |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| `{r['command'].replace(str(tmp / 'out'), 'OUT')}` | {r['wall_s']:.0f} s | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
                  f"{r['rss_vs_fp32']:.2f}x | {r['load_average_before']:.1f} |")
    md.append("")
    md.append(f"Gemma 3 270M fixture, default calibration (8 x 512 tokens), {run['cpu_cores']} cores ({run['cpu']}). "
              f"Command: `python bench/cost.py` at commit {run['git_commit']}.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cost.json").write_text(json.dumps({"run": run, "rows": rows}, indent=2) + "\n")
    (RESULTS / "cost.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
