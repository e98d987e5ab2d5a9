"""The package's layout, read from the source with `ast` (every import counts, at module level or inside a function):
core imports nothing from engine (a model's weights are reached through core.weights), nothing outside the engine
asks for the streamed model itself, no two modules import each other, directly or round a loop, and no two folders
either: the package is floors, each importing only the ones below it. Beside the folders, at most 8 top-level modules,
each saying why it is not in one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "halfsafe"  # read, not imported


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[tuple[str, list[str]]]:
    """(what `node` imports, as absolute dotted names, with the names it takes from it)."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    base = module if node.level == 0 else ".".join(module.split(".")[: len(module.split(".")) + is_package - node.level])
    target = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
    return [(target, [a.name for a in node.names])]


def _halfsafe_modules(target: str, names: list[str]) -> set[str]:
    """The halfsafe modules an import of `names` from `target` loads: `target` (its longest module prefix) and any
    name that is a submodule."""
    out = set()
    for full in [target] + [f"{target}.{n}" for n in names]:
        while full and full not in MODULES:
            full = full.rpartition(".")[0]
        if full:
            out.add(full)
    return out


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    return [(target, names, node.lineno) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for target, names in _imported(module, is_package, node)]


def _graph() -> dict[str, set[str]]:
    return {m: {d for target, names, _ in _imports(m) for d in _halfsafe_modules(target, names)} - {m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_core_imports_nothing_from_the_engine():
    core = [m for m in MODULES if m == "halfsafe.core" or m.startswith("halfsafe.core.")]
    assert "halfsafe.core.weights" in core and len(core) > 10
    bad = [f"{MODULES[m][0].relative_to(PACKAGE.parent)}:{line} imports {target}" for m in core
           for target, names, line in _imports(m)
           if any(d == "halfsafe.engine" or d.startswith("halfsafe.engine.") for d in _halfsafe_modules(target, names))]
    assert not bad, "core must not import the engine (reach a model's weights through core.weights): " + "; ".join(bad)


def test_nothing_outside_the_engine_asks_for_the_streamed_model():
    """Outside engine/, a model is a model: the engine's verbs (in_dtype, in_step, save_fp16, load_streamed) and
    core.weights answer for a streamed one."""
    bad = [f"{MODULES[m][0].relative_to(PACKAGE.parent)}:{line}" for m in MODULES if not m.startswith("halfsafe.engine")
           for target, names, line in _imports(m) if "streamed_of" in names or "Streamed" in names]
    assert not bad, "streamed_of used outside halfsafe.engine: " + ", ".join(bad)


KNOWN_CYCLES: list[list[str]] = []  # none left: a cycle that must stay for now is listed here, with why


def test_no_import_cycles():
    """No module imports one that imports it back, directly or round a loop, counting imports inside functions
    (which hide a cycle from Python, not from the reader)."""
    cycles = _cycles(_graph())
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, take it out of KNOWN_CYCLES: {gone}"


def _floor(module: str) -> str:
    """The folder a module lives in ("halfsafe.io.trust" -> "io"); a top-level module is a floor of its own
    ("halfsafe.errors" -> "errors"), the package's __init__ too ("halfsafe")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _floor_edges() -> dict[tuple[str, str], list[str]]:
    """(floor, floor it imports) -> where: "file:line imports module" for every import that crosses floors."""
    out: dict[tuple[str, str], list[str]] = {}
    for m in MODULES:
        for target, names, line in _imports(m):
            for d in _halfsafe_modules(target, names):
                if _floor(m) != _floor(d):
                    out.setdefault((_floor(m), _floor(d)), []).append(f"{MODULES[m][0].relative_to(PACKAGE.parent)}:{line} imports {d}")
    return out


def test_no_import_cycles_between_folders():
    """core, engine, io, runtime, verify, export, training, families, calibration and the top-level modules: no
    floor imports one that imports it back, directly or round a loop. A loop of folders is a layer whose name says
    it is below another while it reaches up into it (each module alone may still be acyclic)."""
    edges = _floor_edges()
    graph: dict[str, set[str]] = {_floor(m): set() for m in MODULES}
    for a, b in edges:
        graph[a].add(b)
    assert {"core", "engine", "io", "runtime", "verify", "export", "training", "families", "calibration", "files", "convert",
            "cli"} <= set(graph)
    cycles = _cycles(graph)
    where = [w for c in cycles for (a, b), ws in edges.items() if a in c and b in c for w in ws]
    assert not cycles, f"folder cycles {cycles}: " + "; ".join(where)


# Directions that say what a floor is for; the lower one never imports the upper, at module level or in a function.
ONE_WAY = [
    ("io", "engine", "io loads and writes models through the engine (shards, the streamed model, save_fp16); the engine "
                     "reads shards through files/model_folder, below both"),
    ("verify", "runtime", "verify measures the runtimes (the pure-fp16 loader, the baselines, profile emulation); what "
                          "runtime/choose judges a run by (core.collapse, core.metrics) lies in core, below both"),
]


@pytest.mark.parametrize("upper, lower, why", ONE_WAY, ids=[f"{u}-over-{lo}" for u, lo, _ in ONE_WAY])
def test_the_lower_floor_never_imports_the_upper(upper, lower, why):
    edges = _floor_edges()
    assert (upper, lower) in edges, f"{upper} no longer imports {lower}: take it out of ONE_WAY"
    back = edges.get((lower, upper), [])
    assert not back, f"{lower} must not import {upper} ({why}): " + "; ".join(back)


MAX_TOP_LEVEL = 8  # the shape agreed: beside the folders, at most 8 modules, each saying why it is not in one


def _top_level(package: Path) -> dict[str, str]:
    """module name -> its docstring, for every module directly in `package` (its __init__.py and _version.py apart)."""
    return {p.stem: ast.get_docstring(ast.parse(p.read_text(), str(p))) or "" for p in sorted(package.glob("*.py"))
            if p.stem not in ("__init__", "_version")}


def _top_level_problems(package: Path) -> list[str]:
    top = _top_level(package)
    out = [f"{len(top)} top-level modules ({', '.join(top)}), at most {MAX_TOP_LEVEL}: move one into the folder it "
           "belongs to"] if len(top) > MAX_TOP_LEVEL else []
    return out + [f"{name}.py: its docstring says no 'Top level: ' why it is not in a folder"
                  for name, doc in top.items() if not any(line.startswith("Top level: ") for line in doc.splitlines())]


def test_at_most_eight_top_level_modules_each_saying_why():
    """A newcomer reads the folders, then the few modules beside them: each of those says in its docstring, in a line
    "Top level: ...", why it is not in a folder (a 9th, or one that does not say, fails here)."""
    assert {"cli", "errors", "scan"} <= set(_top_level(PACKAGE))
    problems = _top_level_problems(PACKAGE)
    assert not problems, "; ".join(problems)


def test_the_top_level_check_counts_and_reads_docstrings(tmp_path):
    """The check itself, on a package of its own: 8 modules that say why pass; a 9th fails, and so does one that does
    not say; __init__.py and _version.py are not counted."""
    for name in ["__init__", "_version", *(f"m{i}" for i in range(MAX_TOP_LEVEL))]:
        (tmp_path / f"{name}.py").write_text(f'"""{name}.\n\nTop level: a reason.\n"""\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "inside.py").write_text('"""Not top level."""\n')
    assert _top_level_problems(tmp_path) == []
    (tmp_path / "extra.py").write_text('"""One more.\n\nTop level: a reason.\n"""\n')
    assert [p.split(" (")[0] for p in _top_level_problems(tmp_path)] == ["9 top-level modules"]
    (tmp_path / "extra.py").unlink()
    (tmp_path / "m0.py").write_text('"""No reason."""\n')
    assert _top_level_problems(tmp_path) == ["m0.py: its docstring says no 'Top level: ' why it is not in a folder"]


def test_the_checks_see_function_level_and_relative_imports():
    """The reader itself: a relative import inside a function is an edge, and a loop of two is found."""
    tree = ast.parse("def f():\n    from ..engine.streamed import streamed_of\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _imported("halfsafe.core.rewrite", False, node) == [("halfsafe.engine.streamed", ["streamed_of"])]
    assert _imported("halfsafe.core", True, node) == [("halfsafe.engine.streamed", ["streamed_of"])]  # from a package's __init__
    assert _halfsafe_modules("halfsafe.engine", ["streamed"]) == {"halfsafe.engine", "halfsafe.engine.streamed"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert (_floor("halfsafe.io.trust"), _floor("halfsafe.io"), _floor("halfsafe.errors"), _floor("halfsafe")) == \
        ("io", "io", "errors", "halfsafe")
