"""Bytes a variant costs: its weights, and the activations of one forward pass.

CUDA counts its own allocations; on CPU nothing does, so a dispatch mode counts every tensor an op creates
until it dies.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors allocated (and still alive) while active: every op output whose storage is new is
    counted until its last tensor dies; views and in-place results of such tensors count once; views of memory
    made outside (weights, inputs) not at all. Kernel-internal scratch buffers are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage data_ptr -> [bytes, tensors referring to it]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        key = storage_key(t)
        if key is None:
            return
        entry = self.live.get(key)
        if entry is None:
            if key in inputs:
                return  # a view of memory this mode did not see allocated
            nbytes = t.untyped_storage().nbytes()
            entry = self.live[key] = [nbytes, 0]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.current -= entry[0]


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the memory under `t` (shared by its views); None where there is none to count."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return st.data_ptr() if st.nbytes() else None


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers, each storage once (tied weights share one). A streamed model's
    parameters rest on the meta device in the dtype they load in: they count as the model holding them would."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "meta":
            total += t.numel() * t.element_size()  # parameters() yields a tied weight once
            continue
        key = storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def peak_memory(run: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int, str]:
    """Run `run()`; return its output, the peak bytes it allocated beyond what existed before, and how they
    were counted."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = run()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - before, "torch.cuda.max_memory_allocated"
    with LiveTensorBytes() as tracker:
        out = run()
    return out, tracker.peak, "live tensor bytes (dispatch-level tracking)"
