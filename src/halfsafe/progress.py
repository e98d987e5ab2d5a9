"""Progress of the slow phases, and what each one cost.

Top level: engine/, scan, convert/, verify/ and the CLI all report through it.

`with phase("scan", model, passes=8):` counts the model's blocks (`layers.find_blocks`) as they finish: a forward
hook on each block, which a streamed model's blocks run like any other (their pre-hooks load the weights) and which
a `cast_copy` made inside the phase inherits. It shows blocks done / total and, from the first block on, an ETA, and
records the phase's wall and CPU seconds into every `recording()` open around it. `unit="tokens"` counts the model's
own forwards instead (greedy generation: one per token); without a model the caller counts with `advance()`.

The bar and the ETA follow what each unit costs, not how many are done: a block weighs its parameters (each is read
once and multiplied by every position), and the LM head, which no block holds, weighs its own (Gemma 3 270M's is 62%
of the weights: counted in blocks alone, a scan showed `52/54 blocks, ETA 2 s` for 40 s). The head's share is
credited as it computes: each call by the positions it took of its pass's (the scan calls it on chunks of positions),
or by the rows done where the scan's shared head multiplies a slice of rows at a time (`worked`). The ETA is the
seconds per unit of cost so far times the cost left. A caller that counts can weigh each `advance` too (the write:
each tensor by its bytes).

Nothing is shown unless `show()` was called (the CLI does; the Python API stays quiet unless asked): on a terminal a
rich bar, otherwise one plain line every `INTERVAL` seconds (a file, a CI log), never an animated bar.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from contextlib import contextmanager

from .core.lanes import lane
from .core.sites import Hooks, find_blocks

INTERVAL = 10.0  # seconds between plain lines
clock = time.perf_counter  # the phases' wall clock (a test may set its own)
_shown = {"stream": None, "rich": None, "depth": 0}
_recordings: list[list[dict]] = []
_open: list["Phase"] = []  # the phases open now, innermost last


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


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _positions(t) -> int | None:
    """Positions in a hidden state [..., positions, width] (a module's output, or the first of a tuple)."""
    t = t[0] if isinstance(t, (tuple, list)) and t else t
    return t.numel() // t.shape[-1] if hasattr(t, "shape") and t.dim() >= 2 and t.shape[-1] else None


class Phase:
    def __init__(self, name: str, total: int | None, unit: str, passes: int, pass_name: str,
                 cost: float | None = None, head=None, head_cost: int = 0) -> None:
        self.name, self.total, self.unit, self.passes, self.pass_name = name, total, unit, passes, pass_name
        self.per_pass = total // passes if total and passes > 1 else None  # blocks one pass runs: corrected after one
        self.done = self.passes_done = 0
        self.cost = cost if cost is not None else total  # what the units cost in all (unweighted: one each)
        self.cost_done = self.block_cost_done = 0.0
        self.head, self.head_cost = head, head_cost
        self.positions: dict[int | None, int] = {}  # per lane: the positions its last block put out
        self.start, self.cpu_start = clock(), time.process_time()
        self.on_change = lambda: None

    def advance(self, n: int = 1, cost: float | None = None) -> None:
        """`n` units done, costing `cost` (default: one each)."""
        self.done += n
        self.cost_done += n if cost is None else cost
        self.on_change()

    def block_done(self, cost: int, output) -> None:
        self.block_cost_done += cost
        positions = _positions(output)
        if positions:
            self.positions[lane()] = positions
        self.advance(1, cost)

    def head_ran(self, hidden) -> None:
        """The head computed on `hidden`: the share of its cost those positions are of the pass computing now."""
        positions = _positions(hidden)
        whole = self.positions.get(lane()) or positions
        if positions and whole:
            self.cost_done += self.head_cost * min(positions / whole, 1.0)
            self.on_change()

    def end_pass(self) -> None:
        """One forward of the whole model ended: the first tells how many blocks a pass runs (a vision tower's
        blocks do not run on text)."""
        self.passes_done += 1
        if self.unit != "blocks":
            self.advance()
        elif self.passes_done == 1 and self.unit == "blocks" and self.done and self.passes > 1 and self.pass_name:
            self.per_pass, self.total = self.done, self.done * self.passes
            self.cost = (self.block_cost_done + self.head_cost) * self.passes
            self.on_change()

    @property
    def elapsed(self) -> float:
        return clock() - self.start

    def fraction(self) -> float | None:
        """The share of the phase's cost done (what the bar shows), or None where the phase does not know its total."""
        return min(self.cost_done / self.cost, 1.0) if self.cost else None

    def eta(self) -> float | None:
        if not self.cost_done or not self.cost:
            return None
        return self.elapsed / self.cost_done * max(self.cost - self.cost_done, 0)

    def count(self) -> str | None:
        return f"{self.done}/{self.total} {self.unit}" if self.total else f"{self.done} {self.unit}" if self.done else None

    def line(self) -> str:
        parts = [self.count()]
        if self.total and self.done:
            parts.append(f"{100 * self.fraction():.0f}%")
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


def worked(module, share: float) -> None:
    """`share` of `module`'s cost computed outside its forward (engine.shared_head: a slice of the head's rows for one
    sample), credited to every open phase that weighs it."""
    for p in _open:
        if p.head is module:
            p.cost_done += p.head_cost * share
            p.on_change()


@contextmanager
def phase(name: str, model=None, passes: int = 1, unit: str = "blocks", total: int | None = None, pass_name: str | None = "sample",
          quiet: bool = False, cost: float | None = None):
    """One slow phase (see the module's doc). `passes`: how many times each block runs in it (samples); `total`:
    units to expect (default: blocks x passes, or `passes` tokens). `pass_name` None: the passes run in step
    (engine.pipeline), so no pass index is shown and the first pass's end says nothing about blocks per pass.
    `quiet`: count and record, never show. `cost`: what the units a caller counts cost in all (each `advance` then
    gives its own); a model's blocks and head weigh their parameters."""
    hooks = Hooks()
    head, head_cost, weights = None, 0, {}
    if model is not None and unit == "blocks":
        blocks = find_blocks(model)
        weights = {b: _params(model.get_submodule(b)) or 1 for b in blocks}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_cost = _params(head) if head is not None else 0
        if blocks:
            total = total if total is not None else len(blocks) * passes
            cost = cost if cost is not None else (sum(weights.values()) + head_cost) * total / len(blocks)
    p = Phase(name, total if total is not None else (passes if model is not None and unit != "blocks" else None), unit, passes,
              pass_name, cost=cost, head=head if head_cost else None, head_cost=head_cost)
    if model is not None:
        if unit == "blocks":
            for b, w in weights.items():
                hooks.add_post(model.get_submodule(b), lambda module, args, out, w=w: p.block_done(w, out))
            if p.head is not None:
                hooks.add_post(head, lambda module, args, out: p.head_ran(args[0] if args else out))
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
    _open.append(p)
    try:
        with hooks:
            yield p
    finally:
        _open.remove(p)
        if view is not None:
            view.close()
        for phases in _recordings:
            phases.append(p.record())


class _Lines:
    """A plain line every INTERVAL seconds from a timer thread, and a last one at the end if any was printed or the
    phase lasted INTERVAL."""

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
        # a phase as long as the interval says it is done even where the timer thread had no turn to print (a loaded
        # machine); `clock` decides, not the thread
        if self.printed or self.p.elapsed >= INTERVAL:
            p = self.p
            self._print(f"{p.name}: done, " + (f"{p.done} {p.unit}, " if p.done else "") + f"{p.elapsed:.0f} s")


class _Bar:
    """A rich bar on a terminal: one Progress shared by the phases open at once (rich allows one live display)."""

    progress = None

    def __init__(self, p: Phase, stream) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        if _Bar.progress is None:  # the bar is the cost done; the count beside it is in units
            _Bar.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                                     TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
                                     console=Console(file=stream), transient=True)
            _Bar.progress.start()
        _shown["depth"] += 1
        self.p = p
        self.task = _Bar.progress.add_task(p.name, total=p.cost, count=p.count() or "", eta="")
        p.on_change = self.update

    def update(self) -> None:
        eta = self.p.eta()
        _Bar.progress.update(self.task, completed=self.p.cost_done, total=self.p.cost, count=self.p.count() or "",
                             eta="" if eta is None else f"ETA {eta:.0f} s")

    def close(self) -> None:
        _Bar.progress.remove_task(self.task)
        _shown["depth"] -= 1
        if not _shown["depth"]:
            _Bar.progress.stop()
            _Bar.progress = None
