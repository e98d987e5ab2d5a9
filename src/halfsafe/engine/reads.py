"""How often a command reads a streamed model's checkpoint, per phase: the bytes of stored tensors read (the shards'
counter), in passes over the checkpoint (1.0 = every tensor the model computes with, read once). Slices of a wide
weight and the rows an embedding lookup reads count as the part of the checkpoint they are."""

from __future__ import annotations

from contextlib import contextmanager

from .streamed import Streamed, streamed_of


def checkpoint_bytes(s: Streamed) -> int:
    """Bytes of the tensors the model reads (a tied weight's once), as stored."""
    return sum(s.shards.stored_bytes(k) for k in set(s.key_of.values()))


class Reads:
    """Passes over the checkpoint per phase, in the order the phases ran (`to_dict` adds the total). A phase still
    running counts what it has read so far."""

    def __init__(self) -> None:
        self.passes: dict[str, float] = {}
        self._open: list[tuple[str, Streamed, int]] = []

    @contextmanager
    def phase(self, model, name: str):
        """Count what `model` (a streamed one; an in-memory model reads nothing) reads within as phase `name` (phases
        of the same name add up)."""
        s = streamed_of(model)
        if s is None:
            yield
            return
        entry = (name, s, s.shards.bytes_read)
        self._open.append(entry)
        try:
            yield
        finally:
            self._open.remove(entry)
            self._add(self.passes, entry)

    @staticmethod
    def _add(out: dict, entry: tuple) -> None:
        name, s, before = entry
        out[name] = out.get(name, 0.0) + (s.shards.bytes_read - before) / max(1, checkpoint_bytes(s))

    def __bool__(self) -> bool:
        return bool(self.passes or self._open)

    def to_dict(self) -> dict[str, float]:
        out = dict(self.passes)
        for entry in self._open:
            self._add(out, entry)
        out = {k: round(v, 2) for k, v in out.items()}
        return {**out, "total": round(sum(out.values()), 2)}
