#!/usr/bin/env python
"""The benchmarks, group by group: each script, the first line of its docstring, the files it writes in bench/results/
and its command.

    python bench/list.py [GROUP ...]

Read from each script itself, never by running it (most load a model on import): its docstring (the command is the
first `python bench/GROUP/NAME.py ...` line there), its `WRITES` (names or fnmatch patterns in bench/results/; `()`:
it prints only) and its `ON_DEMAND` (those of WRITES that exist only once a run that needs more than this machine, or a
flag, has made them: name -> when). tests/test_bench_listing.py holds every script to that, and every file in
bench/results/ to a script that writes it.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py: ROOT, RESULTS, the import paths
from common import BENCH, GROUPS, RESULTS, ROOT  # noqa: E402

# Files in bench/results/ that no script writes: kept by hand, with where they come from.
BY_HAND = {"verify_stream.md": "raw outputs of `python bench/tools/memory_cap.py 20 -- halfsafe verify ...`, kept by hand"}


def describe(path: Path) -> dict:
    """One script's entry: group, path, summary, command, writes, on_demand (WRITES / ON_DEMAND absent: None)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    doc = ast.get_docstring(tree) or ""
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("WRITES", "ON_DEMAND"):
                consts[node.targets[0].id] = ast.literal_eval(node.value)
    rel = path.relative_to(ROOT).as_posix()
    group = path.parent.name
    writes = consts.get("WRITES")
    found = re.search(rf"python {re.escape(rel)}[^`\n]*", doc)  # the first command the docstring gives
    command = re.split(r"\s{2,}", found.group(0))[0].strip().rstrip(".") if found else f"python {rel}"
    if command.count(")") > command.count("("):  # the command closed a parenthesis of the prose
        command = command.rstrip(")")
    command = ".venv/bin/" + command
    first = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0]
    summary = first if len(first) <= 150 else first[:first.rfind(" ", 0, 146)] + " ..."
    return {"group": group, "path": rel, "summary": summary, "command": command,
            "writes": writes, "on_demand": consts.get("ON_DEMAND", {})}


def scripts() -> list[dict]:
    """Every script of bench/'s group folders, in GROUPS order then by name."""
    paths = [p for g in GROUPS for p in sorted((BENCH / g).glob("*.py"))]
    return sorted((describe(p) for p in paths), key=lambda s: (list(GROUPS).index(s["group"]), s["path"]))


def results_files() -> list[str]:
    """The files in bench/results/ (its tmp/ folder, scratch space of the runs, is not a result)."""
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file())


def writer_of(name: str, entries: list[dict]) -> str | None:
    """The script whose WRITES names or matches `name`, or None."""
    return next((s["path"] for s in entries for pattern in s["writes"] or () if fnmatch.fnmatchcase(name, pattern)), None)


def main(argv: list[str]) -> int:
    unknown = [g for g in argv if g not in GROUPS]
    if unknown:
        print(f"error: no group {unknown[0]!r} in bench/: choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    entries = scripts()
    for group, what in GROUPS.items():
        if argv and group not in argv:
            continue
        print(f"{group}/: {what}")
        for s in (s for s in entries if s["group"] == group):
            moved = "" if s["path"].startswith(f"bench/{group}/") else f" (moves to bench/{group}/)"
            print(f"  {s['path']}{moved}\n      {s['summary']}")
            writes = [f"bench/results/{w}" + (f" ({s['on_demand'][w]})" if w in s["on_demand"] else "") for w in s["writes"] or ()]
            said = ", ".join(writes) or "nothing (prints only)" if s["writes"] is not None else "not said (the script has no WRITES)"
            print(f"      writes: {said}\n      run:    {s['command']}")
        print()
    if not argv:
        print("kept by hand in bench/results/: " + "; ".join(f"{k}: {v}" for k, v in BY_HAND.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
