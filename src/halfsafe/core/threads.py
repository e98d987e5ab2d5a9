"""torch's thread count, held at one for a block of many tiny ops."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_thread():
    """torch on one thread for the duration: tiny ops (a shrunk model, tiny test models, a float16 running sum's K
    small products) only wait on each other across threads on a busy CPU (6x slower measured with two)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
