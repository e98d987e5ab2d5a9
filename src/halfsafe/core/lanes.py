"""Which forward is computing now, where several run in step on one thread (halfsafe.engine.pipeline interleaves
them between blocks): state that hooks keep per forward (the activation collector's stack of running modules) is
kept per lane. The pipeline sets it; hooks only read it, and need not know what runs them."""

from __future__ import annotations

_lane: int | None = None


def lane() -> int | None:
    """The index of the forward computing now inside an in-step pass, or None outside one."""
    return _lane


def set_lane(i: int | None) -> None:
    """Forward `i` computes from now on (None: no pass runs)."""
    global _lane
    _lane = i
