"""The float16 kernels a runtime profile names (`RuntimeProfile.kernels`), one module per kind of float16
arithmetic: how attention, the graph's norms and activation modules compute under that runtime. The linears'
float16 accumulation is data every profile carries (`matmul_chunk`, `split_k`), emulated in runtime.emulate.

A kernel module provides `NAME` (the profile's `kernels`), `attention(profile)` (the attention function's
registered name and the function, transformers' eager signature), `graph_norm_forward(original, profile)` and
`activation_forward(original)` (a module's forward under those kernels, or None: PyTorch's). A new kind of float16
arithmetic is one module here, its scalar arithmetic in core/ (as core/arith16_webgpu.py), a RuntimeProfile naming
it (runtime/profiles.py) and its tests against the real runtime (as tests/test_ort_webgpu_ops.py).
"""

from __future__ import annotations

from types import ModuleType

from ...errors import HalfsafeError
from . import generic, ort_webgpu

KERNELS: dict[str, ModuleType] = {m.NAME: m for m in (generic, ort_webgpu)}


def kernels_for(name: str) -> ModuleType:
    """The kernel module named `name` (a profile's `kernels`)."""
    module = KERNELS.get(name)
    if module is None:
        raise HalfsafeError(f"no float16 kernels named {name!r}: halfsafe.runtime.kernels has {', '.join(KERNELS)}")
    return module
