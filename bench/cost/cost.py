#!/usr/bin/env python
"""The cost table of docs/results.md: wall time and peak memory of the real commands on the Gemma 3 270M fixture, each run
under a hard memory cap (a cgroup v1 memory controller, `bench/tools/memory_cap.py`).

    .venv/bin/python bench/cost/cost.py            # writes bench/results/cost.{json,md}

The caps are the memory goals: `convert` within 1.0x the float32 model (1.07 GB), `demo` (scan, convert, verify)
within 1.5x; `scan` and the whole-model convert (`--whole`, the path the block-by-block engine replaced, for the
time comparison) run under a loose cap. A run that needs more than its cap is killed (exit -9), so exit 0 under
the cap shows the bound. The load average before each run is recorded: on a shared machine times are upper bounds.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

from memory_cap import run_capped  # noqa: E402
from run_benchmarks import run_info  # noqa: E402

WRITES = ("cost.json", "cost.md")  # in bench/results/ (python bench/list.py)

FP32_BYTES = 268_098_176 * 4  # Gemma 3 270M parameters x 4 bytes: the fp32 model the ratios refer to
LOOSE = 20.0  # x fp32: no cap in practice


def measure(args: list[str], cap_x: float) -> dict:
    load = os.getloadavg()[0]
    r = run_capped(int(cap_x * FP32_BYTES), [sys.executable, "-m", "halfsafe.cli", *args])
    if r["exit"] != 0:
        print(f"halfsafe {' '.join(args)}: exit {r['exit']} under a cap of {cap_x}x", file=sys.stderr)
    return {"command": "halfsafe " + " ".join(args), "cap_x": cap_x, "exit": r["exit"], "wall_s": r["wall_s"],
            "peak_rss_bytes": int(r["peak_rss_gb"] * 1e9), "rss_vs_fp32": round(r["peak_rss_gb"] * 1e9 / FP32_BYTES, 2),
            "cgroup_peak_gb": r["cgroup_peak_gb"], "load_average_before": load}


def main() -> int:
    from halfsafe.io.builtin import gemma3_270m_folder

    gemma3_270m_folder()  # build the fixture first, outside the measurements
    run = run_info()
    tmp = Path(tempfile.mkdtemp(prefix="halfsafe-cost-"))
    try:
        rows = [measure(["scan", "gemma3-270m", "--fp16-check"], LOOSE),
                measure(["convert", "gemma3-270m", str(tmp / "streamed")], 1.0),
                measure(["convert", "gemma3-270m", str(tmp / "whole"), "--whole"], LOOSE),
                measure(["demo", "--out", str(tmp / "demo")], 1.5)]
        same = filecmp.cmp(tmp / "streamed/model.safetensors", tmp / "whole/model.safetensors", shallow=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    md = ["| command | hard cap (x fp32) | exit | wall time | peak RSS | vs the 1.07 GB fp32 model | load average before |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cap = "none" if r["cap_x"] == LOOSE else f"{r['cap_x']:.1f}x ({r['cap_x'] * FP32_BYTES / 1e9:.2f} GB)"
        command = r["command"]
        for name in ("streamed", "whole", "demo"):
            command = command.replace(str(tmp / name), "OUT")
        md.append(f"| `{command}` | {cap} | "
                  f"{r['exit']} | {r['wall_s']:.0f} s | {r['peak_rss_bytes'] / 1e9:.2f} GB | {r['rss_vs_fp32']:.2f}x | "
                  f"{r['load_average_before']:.1f} |")
    convert, whole = rows[1], rows[2]
    md.append("")
    md.append(f"Block by block vs whole model: {convert['wall_s'] / whole['wall_s']:.2f}x the time; the two "
              f"`model.safetensors` are {'byte-identical' if same else 'DIFFERENT'}.")
    md.append(f"Gemma 3 270M fixture, default calibration (8 x 512 tokens), {run['cpu_cores']} cores ({run['cpu']}). "
              f"Command: `python bench/cost/cost.py` at commit {run['git_commit']}.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cost.json").write_text(json.dumps({"run": run, "rows": rows, "outputs_identical": same}, indent=2) + "\n")
    (RESULTS / "cost.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
