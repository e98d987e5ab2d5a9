"""Several forwards of one streamed model in step, so that each unit is read once for all of them.

`in_step(model, runs)` runs each of `runs` (one sample's forward) as a coroutine (a greenlet, on this thread). A run
that reaches a block's pre-hook waits there; when every run still going waits at the same block, it is read once, and
the runs go on one after another, in order, each to its next block. A block is freed when the last run has left it;
the stem (embeddings, norms, head) is held for the whole pass. Runs wait only between blocks, where what each holds is
its hidden state: a wide weight (engine.wide) is read a slice at a time by each run, as alone, since runs waiting
inside a product would each hold its output (8 x 512 x 18944 floats at 7B). Each run computes
exactly what it computes alone, the same ops on the same tensors; only what happens between runs is interleaved:
  - per-run torch state: grad mode and the dispatch and function modes a run enters for itself (verify's
    activation-bytes counter) are put aside when it waits and given back when it goes on;
  - state that hooks keep per forward (the activation collector's stack of running modules) is kept per run, by
    `core.lanes.lane()`, the index of the run computing now.
Runs that wait on different things (their paths through the model differ) are reported as a warning, and from there
each finishes alone, one after another, loading its units as it would by itself: slower, never a wrong order.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from greenlet import greenlet
from torch.utils._python_dispatch import _len_torch_dispatch_stack, _pop_mode, _push_mode

from ..core.lanes import lane, set_lane
from .streamed import streamed_of

log = logging.getLogger(__name__)

_apart = False  # `apart()`: every in_step runs its runs one after another (the per-sample passes, for comparison)


@contextmanager
def apart():
    """Within: `in_step` runs one forward after another, each reading the units it needs, as before pipelining."""
    global _apart
    saved, _apart = _apart, True
    try:
        yield
    finally:
        _apart = saved


@dataclass
class _TorchState:
    """What a run changed of torch's thread-local state, kept while it waits."""

    grad: bool
    dispatch: list = field(default_factory=list)  # modes above the pass's own, innermost last
    function: list = field(default_factory=list)


class Gate:
    """The place runs wait (see the module docstring); held by the Streamed while `in_step` runs."""

    def __init__(self, streamed, n: int) -> None:
        self.streamed = streamed
        self.n = n
        self.parent = greenlet.getcurrent()
        self.together = True
        self.inside: dict[str, set[int]] = {}  # unit -> runs that were let in together and have not left it

    # ----- called by the Streamed, in a run
    def wait(self, what: tuple):
        """Wait for `what` (("unit", name)) with the others; True once the pass has loaded it, None when this run must
        load it itself (outside a run, or the runs no longer go together)."""
        if not self.together or greenlet.getcurrent() is self.parent:
            return None
        return self.parent.switch(what)

    def holds(self, unit: str) -> bool:
        """Whether `unit` must stay loaded as this run leaves it: runs let in with this one have yet to leave."""
        waiting = self.inside.get(unit)
        if waiting is None:
            return False
        waiting.discard(lane())
        if waiting:
            return True
        del self.inside[unit]
        return False

    # ----- the pass
    def run(self, runs: list[Callable], then: Callable | None) -> list:
        n = len(runs)
        self._base = (torch.is_grad_enabled(), _len_torch_dispatch_stack(), torch._C._len_torch_function_stack())
        self._states = [_TorchState(self._base[0]) for _ in runs]
        results, errors, done = [None] * n, {}, [False] * n
        consumed = 0

        def body(i):
            try:
                results[i] = runs[i]()
            except BaseException as e:  # noqa: BLE001  (raised again by the pass, after the others are stopped)
                errors[i] = e

        def go(i: int, answer) -> None:
            """Resume run i; then hand on, in order, every result that is ready (before the next run makes its own:
            one sample's output alive at a time, as alone)."""
            nonlocal consumed
            self._resume(lanes, i, answer, waits, done)
            if errors:
                raise errors[min(errors)]
            while consumed < n and done[consumed]:
                if then is not None:
                    then(consumed, results[consumed])
                    results[consumed] = None
                consumed += 1

        lanes = [greenlet(lambda i=i: body(i), parent=self.parent) for i in range(n)]
        waits: dict[int, tuple] = {}
        self._started: set[int] = set()
        with self.streamed.held():
            try:
                for i in range(n):
                    go(i, None)
                while True:
                    live = [i for i in range(n) if not done[i]]
                    if not live:
                        break
                    wanted = {waits[i] for i in live}
                    if self.together and len(wanted) == 1:
                        answer = self._serve(wanted.pop(), live)
                        for i in live:
                            go(i, answer)
                        continue
                    if self.together:
                        log.warning("the samples took different paths through the model (%s); running the rest of them one "
                                    "at a time", " vs ".join(_describe(w) for w in sorted(wanted, key=str)[:2]))
                        self.together = False
                    i = live[0]  # alone, to its end: its later waits return at once
                    go(i, self._serve(waits[i], [i]))
            finally:
                self.together = False  # what a run still does as it is stopped, it does alone
                for i in sorted(self._started):
                    if not done[i]:
                        self._resume(lanes, i, None, waits, done, throw=True)
                for unit in list(self.inside):
                    self.inside.pop(unit)
                    self.streamed._offload(unit)
        return results

    def _serve(self, what: tuple, lanes: list[int]):
        name = what[1]  # ("unit", name)
        self.streamed._onload(name)
        self.inside[name] = set(lanes)
        return True

    def _resume(self, lanes, i: int, value, waits: dict, done: list, throw: bool = False) -> None:
        self._restore(i)
        set_lane(i)
        try:
            if throw:
                what = lanes[i].throw(_Stopped)
            elif i in self._started:
                what = lanes[i].switch(value)
            else:
                self._started.add(i)
                what = lanes[i].switch()
        finally:
            set_lane(None)
            self._put_aside(i)
        if lanes[i].dead:
            done[i] = True
            waits.pop(i, None)
        else:
            waits[i] = what

    def _put_aside(self, i: int) -> None:
        s = self._states[i]
        s.grad = torch.is_grad_enabled()
        s.dispatch = [_pop_mode() for _ in range(_len_torch_dispatch_stack() - self._base[1])][::-1]
        s.function = [torch._C._pop_torch_function_stack()
                      for _ in range(torch._C._len_torch_function_stack() - self._base[2])][::-1]
        torch.set_grad_enabled(self._base[0])

    def _restore(self, i: int) -> None:
        s = self._states[i]
        torch.set_grad_enabled(s.grad)
        for m in s.function:
            torch._C._push_on_torch_function_stack(m)
        for m in s.dispatch:
            _push_mode(m)
        s.dispatch, s.function = [], []


class _Stopped(Exception):
    """Thrown into the runs still waiting when the pass fails: an Exception (not GreenletExit), so that torch runs the
    hooks it always calls as a module's forward fails, and every unit they entered is left as a failed forward leaves it."""


def _describe(what: tuple) -> str:
    return what[1]


def in_step(model, runs: list[Callable], then: Callable | None = None, until: Callable[[], bool] | None = None) -> list:
    """Each of `runs()` (zero-argument callables, each one forward of `model` and what is done with it), every unit of
    a streamed model read once for all of them (see the module docstring); their results in order. `then(i, result)`,
    if given, gets each result as soon as it and every one before it is ready (and the result is not kept): one
    sample's output at a time, in order. An in-memory model, a single run, or a pass inside a pass: one run after
    another, as ever, and once `until()` (if given) holds after a run, the rest are not run (runs in step all run:
    they cost one read of the model together)."""
    s = streamed_of(model)
    if s is None or len(runs) < 2 or s._gate is not None or _apart:
        out = []
        for i, run in enumerate(runs):
            r = run()
            if then is not None:
                then(i, r)
                r = None
            out.append(r)
            if until is not None and until():
                break
        return out
    s._gate = Gate(s, len(runs))
    try:
        return s._gate.run(runs, then)
    finally:
        s._gate = None
