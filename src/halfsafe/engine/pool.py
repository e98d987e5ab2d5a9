"""Tensors a streamed pass let go of, kept for the next read of the same size.

A streamed pass reads every block's tensors in turn, each into a fresh tensor, and frees them when the block is done;
the next block asks for the same sizes. A fresh tensor of that size is memory the process has just given back to
the system (large allocations are mapped and unmapped), so each read first pays for touching its pages anew: on the
CPUs measured about 2 ns an element, more than converting bfloat16 to float32 into memory already touched (0.7 ns).
The pool keeps what was let go and hands it to the next read of that size and dtype.

Safety: a tensor enters only when nothing else holds its storage (no parameter, view, cache or hook: the storage's
use count says so), so nothing can see it change when it is reused. Memory: a request the pool cannot serve empties
it before anything is allocated, so the pool never holds memory beside a new allocation: what a pass holds at most
is what it held without the pool.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; where torch lacks it, nothing is pooled


def sole_owner(t: torch.Tensor) -> bool:
    """`t` is the only tensor on its storage, and the whole of it (so a reuse changes nothing anyone else sees)."""
    if _use_count is None or t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset():
        return False
    storage = t.untyped_storage()
    # 2: `t`'s own reference and `storage`'s (measured on torch 2.x: a parameter or a view on it makes 3)
    return storage.nbytes() == t.numel() * t.element_size() and _use_count(storage._cdata) == 2


class Pool:
    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.reused = 0  # tensors handed out again (tests read it)

    def give(self, t) -> None:
        """Keep `t` for a later `take`, if nothing else holds it (see `sole_owner`); else leave it alone."""
        if isinstance(t, torch.Tensor) and t.is_floating_point() and sole_owner(t):
            self._free[(t.numel(), t.dtype)].append(t.view(-1))

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """A kept tensor of `shape` and `dtype` (its old values in it), or None, having emptied the pool (below)."""
        free = self._free.get((math.prod(shape), dtype))
        if not free:
            self.clear()  # what is kept fits nothing asked for now: give the memory back before the caller allocates
            return None
        self.reused += 1
        return free.pop().view(tuple(shape))

    def clear(self) -> None:
        self._free.clear()

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
