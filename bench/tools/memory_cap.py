"""Run a command under a hard memory cap (a cgroup v1 memory controller, as root) and report its peak.

    python bench/tools/memory_cap.py CAP_GB -- halfsafe convert MODEL OUT

The cap covers everything the command charges: its anonymous memory and the page cache of the files it reads and
writes (the kernel reclaims cache under the cap; only memory it cannot reclaim kills the run). Swap is off on these
machines. Prints one JSON line: exit code, wall seconds, CPU seconds (user + system, the command and the children it
waited for), peak RSS of the command (its own getrusage), the cgroup's peak usage (page cache included), and how often
usage reached the cap (an OOM kill shows as exit code -9). `run_capped(None, argv)` measures the same without a cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

WRITES = ()  # prints only: nothing in bench/results/ (python bench/list.py)

ROOT = Path("/sys/fs/cgroup/memory")


def run_capped(cap_bytes: int | None, argv: list[str], **popen) -> dict:
    if cap_bytes is None:
        return _measured(argv, popen)
    group = ROOT / f"halfsafe-bench-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        try:
            (group / "memory.memsw.limit_in_bytes").write_text(str(cap_bytes))  # no swap escape, where accounted
        except OSError:
            pass
        r = _measured(argv, dict(popen, preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid()))))
        return {**r, "cap_gb": cap_bytes / 1e9,
                "cgroup_peak_gb": int((group / "memory.max_usage_in_bytes").read_text()) / 1e9,
                "times_at_cap": int((group / "memory.failcnt").read_text())}
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _measured(argv: list[str], popen: dict) -> dict:
    start = time.time()
    proc = subprocess.Popen(argv, **popen)
    _, status, usage = os.wait4(proc.pid, 0)
    return {"argv": argv, "exit": os.waitstatus_to_exitcode(status), "wall_s": round(time.time() - start, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}


def main() -> None:
    cap, sep, *argv = sys.argv[1:]
    assert sep == "--", __doc__
    print(json.dumps(run_capped(int(float(cap) * 1e9), argv)))


if __name__ == "__main__":
    main()
