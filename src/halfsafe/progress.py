"""Progress of the slow phases, and what each one cost.

`with phase("scan", model, passes=8):` counts the model's blocks (`layers.find_blocks`) as they finish: a forward
hook on each block, which a streamed model's blocks run like any other (their pre-hooks load the weights) and which
a `cast_copy` made inside the phase inherits. It shows blocks done / total and, from the first block on, an ETA
(seconds per block so far times the blocks left), and records the phase's wall and CPU seconds into every
`recording()` open around it. `unit="tokens"` counts the model's own forwards instead (greedy generation: one per
token); without a model the caller counts with `advance()`.

Nothing is shown unless `show()` was called (the CLI does; the Python API stays quiet unless asked): on a terminal a
rich bar, otherwise one plain line every `INTERVAL` seconds (a file, a CI log), never an animated bar.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from contextlib import contextmanager

from .core.sites import Hooks, find_blocks

INTERVAL = 10.0  # seconds between plain lines
_shown = {"stream": None, "rich": None, "depth": 0}
_recordings: list[list[dict]] = []


def show(stream=None, rich: bool | None = None) -> None:
    """Show progress from now on, on `stream` (default: sys.stderr as it is when each phase starts): a rich bar when
    it is a terminal (or `rich`), plain lines otherwise. `hide()` is quiet again."""
    _shown["stream"], _shown["rich"] = stream or "stderr", rich


def hide() -> None:
    _shown["stream"] = None


def _view(p: "Phase"):
    stream = _shown["stream"]
    if stream is None:
        return None
    stream = sys.stderr if stream == "stderr" else stream
    rich = _shown["rich"] if _shown["rich"] is not None else bool(getattr(stream, "isatty", lambda: False)())
    return _Bar(p, stream) if rich else _Lines(p, stream)


@contextmanager
def recording():
    """Yield a list that receives {"name", "wall_s", "cpu_s"} of every phase that ends inside the block."""
    phases: list[dict] = []
    _recordings.append(phases)
    try:
        yield phases
    finally:
        _recordings.remove(phases)


def recorded(fn):
    """Decorate a function returning a report: the report's `phases` are those that ended during the call."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with recording() as phases:
            report = fn(*args, **kwargs)
        report.phases = phases
        return report
    return call


class Phase:
    def __init__(self, name: str, total: int | None, unit: str, passes: int, pass_name: str) -> None:
        self.name, self.total, self.unit, self.passes, self.pass_name = name, total, unit, passes, pass_name
        self.per_pass = total // passes if total and passes > 1 else None  # blocks one pass runs: corrected after one
        self.done = self.passes_done = 0
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.on_change = lambda: None

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.on_change()

    def end_pass(self) -> None:
        """One forward of the whole model ended: the first tells how many blocks a pass runs (a vision tower's
        blocks do not run on text)."""
        self.passes_done += 1
        if self.unit != "blocks":
            self.advance()
        elif self.passes_done == 1 and self.unit == "blocks" and self.done and self.passes > 1 and self.pass_name:
            self.per_pass, self.total = self.done, self.done * self.passes
            self.on_change()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self) -> float | None:
        if not self.done or not self.total:
            return None
        return self.elapsed / self.done * max(self.total - self.done, 0)

    def line(self) -> str:
        parts = [f"{self.done}/{self.total} {self.unit}" if self.total else f"{self.done} {self.unit}" if self.done else None]
        if self.passes > 1 and self.unit == "blocks" and self.pass_name:
            at = min((self.done // self.per_pass if self.per_pass else self.passes_done) + 1, self.passes)
            parts.append(f"{self.pass_name} {at}/{self.passes}")
        parts.append(f"{self.elapsed:.0f} s")
        eta = self.eta()
        if eta is not None:
            parts.append(f"ETA {eta:.0f} s")
        return f"{self.name}: " + ", ".join(p for p in parts if p)

    def record(self) -> dict:
        return {"name": self.name, "wall_s": round(self.elapsed, 3), "cpu_s": round(time.process_time() - self.cpu_start, 3)}


@contextmanager
def phase(name: str, model=None, passes: int = 1, unit: str = "blocks", total: int | None = None, pass_name: str | None = "sample",
          quiet: bool = False):
    """One slow phase (see the module's doc). `passes`: how many times each block runs in it (samples); `total`:
    units to expect (default: blocks x passes, or `passes` tokens). `pass_name` None: the passes run in step
    (engine.pipeline), so no pass index is shown and the first pass's end says nothing about blocks per pass.
    `quiet`: count and record, never show."""
    hooks = Hooks()
    if model is not None and unit == "blocks":
        blocks = find_blocks(model)
        total = total if total is not None else len(blocks) * passes or None
    p = Phase(name, total if total is not None else (passes if model is not None and unit != "blocks" else None), unit, passes,
              pass_name)
    if model is not None:
        if unit == "blocks":
            for b in blocks:
                hooks.add_post(model.get_submodule(b), lambda *a: p.advance())
        depth = [0]  # a pass is the outermost of the model's and its base model's forwards (scan runs the base alone)

        def enter(*a):
            depth[0] += 1

        def leave(*a):
            depth[0] -= 1
            if not depth[0]:
                p.end_pass()

        for root in {id(m): m for m in (model, getattr(model, "base_model", None)) if m is not None}.values():
            hooks.add_pre(root, enter)
            hooks.add_post(root, leave, always_call=True)
    view = None if quiet else _view(p)
    try:
        with hooks:
            yield p
    finally:
        if view is not None:
            view.close()
        for phases in _recordings:
            phases.append(p.record())


class _Lines:
    """A plain line every INTERVAL seconds from a timer thread, and a last one at the end if any was printed."""

    def __init__(self, p: Phase, stream) -> None:
        self.p, self.stream, self.printed = p, stream, False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="halfsafe-progress", daemon=True)
        self.thread.start()

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
        self.printed = True

    def _run(self) -> None:
        while not self.stop.wait(INTERVAL):
            self._print(self.p.line())

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.printed:
            p = self.p
            self._print(f"{p.name}: done, " + (f"{p.done} {p.unit}, " if p.done else "") + f"{p.elapsed:.0f} s")


class _Bar:
    """A rich bar on a terminal: one Progress shared by the phases open at once (rich allows one live display)."""

    progress = None

    def __init__(self, p: Phase, stream) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if _Bar.progress is None:
            _Bar.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
                                     console=Console(file=stream), transient=True)
            _Bar.progress.start()
        _shown["depth"] += 1
        self.p = p
        self.task = _Bar.progress.add_task(p.name, total=p.total, unit=p.unit, eta="")
        p.on_change = self.update

    def update(self) -> None:
        eta = self.p.eta()
        _Bar.progress.update(self.task, completed=self.p.done, total=self.p.total,
                             eta="" if eta is None else f"ETA {eta:.0f} s")

    def close(self) -> None:
        _Bar.progress.remove_task(self.task)
        _shown["depth"] -= 1
        if not _shown["depth"]:
            _Bar.progress.stop()
            _Bar.progress = None
