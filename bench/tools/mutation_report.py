#!/usr/bin/env python
"""Summarise mutmut runs (scripts/mutation) into bench/results/mutation.{md,json}: per module, how many mutants
the fast tests killed, and every survivor by name (`mutmut show NAME` prints its diff) with the reason it is left,
from bench/tools/mutation_equivalent.toml (fnmatch patterns on mutant names).

    python bench/tools/mutation_report.py [[LABEL=]MUTANTS_DIR ...]

Several runs combine (default: ./mutants alone): a mutant's verdict is the one of the last folder that checked it,
so per-module runs, or a run of only the survivors of an earlier one, merge into one table. A run over a subset of
the configured test selection may go first: what a subset kills, the whole selection kills too. LABEL names a
folder in the report (default: its path)."""

from __future__ import annotations

import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, git_commit  # noqa: E402

import tomllib
from mutmut.stats import status_by_exit_code

WRITES = ("mutation.json", "mutation.md")  # in bench/results/ (python bench/list.py)

REASONS = Path(__file__).resolve().parent / "mutation_equivalent.toml"
KILLED = ("killed", "timeout", "caught by type check")  # a timeout counts as killed
LEFT = ("survived", "no tests")  # "no tests": nothing in the fast subset runs the function


def read_runs(folders: list[Path]) -> dict[str, dict[str, str]]:
    """module -> mutant name -> status, the last folder that checked a mutant deciding it."""
    modules: dict[str, dict[str, str]] = {}
    for folder in folders:
        metas = sorted(folder.rglob("*.py.meta"))
        if not metas:
            raise SystemExit(f"no mutmut results under {folder}: run scripts/mutation first")
        for meta in metas:
            module = str(meta.relative_to(folder))[: -len(".meta")]
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                status = status_by_exit_code[code]
                seen = modules.setdefault(module, {})
                if status != "not checked" or name not in seen:
                    seen[name] = status
    return modules


def read_reasons(path: Path = REASONS) -> list[tuple[str, str]]:
    """(pattern, reason) in file order: the first pattern a name matches gives its reason."""
    if not path.exists():
        return []
    return [(r["pattern"], r["reason"]) for r in tomllib.loads(path.read_text()).get("survivor", [])]


def reason_for(name: str, reasons: list[tuple[str, str]]) -> str | None:
    return next((why for pattern, why in reasons if fnmatch.fnmatchcase(name, pattern)), None)


def summarise(modules: dict[str, dict[str, str]], reasons: list[tuple[str, str]]) -> dict:
    per_module = {m: dict(Counter(s.values())) for m, s in sorted(modules.items())}
    checked = {m: sum(v for k, v in c.items() if k != "not checked") for m, c in per_module.items()}
    killed = {m: sum(c.get(k, 0) for k in KILLED) for m, c in per_module.items()}
    survivors = sorted(n for s in modules.values() for n, st in s.items() if st in LEFT)
    total_checked, total_killed = sum(checked.values()), sum(killed.values())
    return {
        "score": total_killed / total_checked if total_checked else 0.0,
        "killed": total_killed,
        "checked": total_checked,
        "per_module": per_module,
        "survivors": {n: reason_for(n, reasons) for n in survivors},
    }


def markdown(summary: dict, commit: str, runs: list[str]) -> str:
    md = [f"Mutation testing (`scripts/mutation`, mutmut 3.8.1) at commit {commit}: **{summary['killed']} of "
          f"{summary['checked']} checked mutants killed ({100 * summary['score']:.1f}%)**; a timeout counts as killed, "
          "\"no tests\" as survived.", "", "Runs combined (the last run that checked a mutant decides its verdict):", "",
          *[f"{i}. {run}" for i, run in enumerate(runs, 1)], "",
          "A run over part of the configured test selection (pyproject.toml [tool.mutmut]) is enough for a kill: what "
          "a part of the selection kills, the whole selection kills too.", "",
          "| module | killed | survived | no tests | timeout | not checked | score |", "|---|---:|---:|---:|---:|---:|---:|"]
    for module, c in summary["per_module"].items():
        checked = sum(v for k, v in c.items() if k != "not checked")
        killed = sum(c.get(k, 0) for k in KILLED)
        score = f"{100 * killed / checked:.1f}%" if checked else "-"
        md.append(f"| {module} | {c.get('killed', 0)} | {c.get('survived', 0)} | {c.get('no tests', 0)} | {c.get('timeout', 0)} "
                  f"| {c.get('not checked', 0)} | {score} |")
    unexplained = sum(1 for why in summary["survivors"].values() if why is None)
    md += ["", f"Survivors ({len(summary['survivors'])}, {unexplained} without a recorded reason; reasons from "
               "bench/tools/mutation_equivalent.toml):", ""]
    md += [f"- `{name}`: {why or 'no reason recorded yet'}" for name, why in summary["survivors"].items()]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    runs = [a.split("=", 1) if "=" in a else (a, a) for a in args] or [("mutants", str(ROOT / "mutants"))]
    folders, labels = [Path(path) for _, path in runs], [label for label, _ in runs]
    summary = summarise(read_runs(folders), read_reasons())
    commit = git_commit()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mutation.json").write_text(json.dumps({"commit": commit, "runs": labels, **summary}, indent=2) + "\n")
    md = markdown(summary, commit, labels)
    (RESULTS / "mutation.md").write_text(md)
    print("\n".join(md.splitlines()[: 8 + len(folders) + len(summary["per_module"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
