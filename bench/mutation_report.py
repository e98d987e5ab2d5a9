#!/usr/bin/env python
"""Summarise a mutmut run (scripts/mutation) into bench/results/mutation.{md,json}: per module, how many mutants
the fast tests killed, and every survivor by name (`mutmut show NAME` prints its diff)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from run_benchmarks import RESULTS, git_commit  # noqa: E402


def main() -> int:
    metas = sorted((ROOT / "mutants").rglob("*.py.meta"))
    if not metas:
        raise SystemExit("no mutmut results under mutants/: run scripts/mutation first")
    per_module, survivors = {}, []
    for meta in metas:
        module = str(meta.relative_to(ROOT / "mutants"))[: -len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        status = {name: status_by_exit_code[code] for name, code in codes.items()}
        per_module[module] = dict(Counter(status.values()))
        survivors += [name for name, s in status.items() if s in ("survived", "no tests")]
    total = Counter()
    for counts in per_module.values():
        total.update(counts)
    checked = sum(v for k, v in total.items() if k != "not checked")
    killed = total.get("killed", 0) + total.get("timeout", 0) + total.get("caught by type check", 0)
    score = killed / checked if checked else 0.0
    md = [f"Mutation testing (`scripts/mutation`, mutmut 3.8.1) at commit {git_commit()}: **{killed} of {checked} "
          f"checked mutants killed ({100 * score:.1f}%)**; a timeout counts as killed.", "",
          "| module | killed | survived | no tests | timeout | not checked |", "|---|---:|---:|---:|---:|---:|"]
    for module, c in per_module.items():
        md.append(f"| {module} | {c.get('killed', 0)} | {c.get('survived', 0)} | {c.get('no tests', 0)} | "
                  f"{c.get('timeout', 0)} | {c.get('not checked', 0)} |")
    md += ["", f"Survivors ({len(survivors)}):", ""] + [f"- `{s}`" for s in sorted(survivors)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mutation.json").write_text(json.dumps({"commit": git_commit(), "score": score, "per_module": per_module,
                                                        "survivors": sorted(survivors)}, indent=2) + "\n")
    (RESULTS / "mutation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[:4 + len(per_module) + 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
