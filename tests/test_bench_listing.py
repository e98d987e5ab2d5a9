"""`python bench/list.py`: every script of bench/ listed under its group with what it writes, read from the script itself,
and every file in bench/results/ accounted for by a script that writes it (or kept by hand, said where from)."""

import fnmatch
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _listing():
    spec = importlib.util.spec_from_file_location("bench_list", BENCH / "list.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_is_listed_with_its_group_and_command():
    listing = _listing()
    done = subprocess.run([sys.executable, str(BENCH / "list.py")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    scripts = sorted(p for p in BENCH.rglob("*.py") if p.parent != BENCH or p.name not in ("common.py", "list.py"))
    entries = {s["path"]: s for s in listing.scripts()}
    assert sorted(entries) == sorted(p.relative_to(ROOT).as_posix() for p in scripts)
    for group in listing.GROUPS:
        assert f"\n{group}/: " in "\n" + out
    for path, s in entries.items():
        assert f"  {path}" in out and f"run:    {s['command']}" in out, path
        assert s["command"].startswith(f".venv/bin/python {path}") or s["command"].startswith(".venv/bin/PYTHONPATH"), s
        assert s["summary"], f"{path} has no docstring"
        group = Path(path).parent.name
        assert group in listing.GROUPS, f"{path}: bench/{group}/ is not a group of common.GROUPS"


def test_every_script_names_what_it_writes_and_every_name_is_there_or_said_when():
    listing = _listing()
    results = listing.results_files()
    for s in listing.scripts():
        assert s["writes"] is not None, f"{s['path']} names nothing it writes: give it WRITES = (...) (() if it prints only)"
        for pattern in s["writes"]:
            assert "/" not in pattern, f"{s['path']}: WRITES names files in bench/results/, not {pattern!r}"
            present = fnmatch.filter(results, pattern)
            assert present or s["on_demand"].get(pattern), \
                f"{s['path']} writes {pattern!r}: not in bench/results/ and not in its ON_DEMAND (with when it is made)"
        assert set(s["on_demand"]) <= set(s["writes"]), f"{s['path']}: ON_DEMAND names what WRITES does not"


def test_every_result_file_has_a_writer():
    listing = _listing()
    entries = listing.scripts()
    for name in listing.results_files():
        assert listing.writer_of(name, entries) or name in listing.BY_HAND, \
            f"bench/results/{name}: no script's WRITES names it (nor BY_HAND in bench/list.py)"
    for name in listing.BY_HAND:
        assert (BENCH / "results" / name).is_file(), f"BY_HAND names bench/results/{name}, which is not there"


def test_an_unknown_group_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(BENCH / "list.py"), "speed"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "fidelity" in done.stderr, done.stderr
    one = subprocess.run([sys.executable, str(BENCH / "list.py"), "training"], capture_output=True, text=True, timeout=60)
    assert one.returncode == 0 and "training/: " in one.stdout and "fidelity/: " not in one.stdout
    assert "bench/training/rl_fp16.py" in one.stdout


def test_common_points_at_this_checkout():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    common = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(common)
        assert common.ROOT == ROOT and common.RESULTS == ROOT / "bench" / "results"
        for group in common.GROUPS:  # a script imports another one by name from any group
            assert str(BENCH / group) in sys.path and (BENCH / group).is_dir()
        assert sys.path[: len(saved)] == saved  # appended: tests/ and installed packages are not shadowed
    finally:
        sys.path[:] = saved
