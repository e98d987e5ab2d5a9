"""How the float16 trials compute (convert's candidates, `scan --fp16-check`, verify's float16 variants):
PyTorch's own float16 kernels ("native"), or the same arithmetic from float32 matrix kernels ("emulated").

PyTorch's CPU float16 ops take and give float16 tensors and compute inside in float32: a matrix product multiplies
float16 operands exactly in float32, accumulates in float32 and rounds its result once to float16. A float32 kernel
on the same operands followed by that one rounding computes the same, up to the order of the float32 sums: what two
float16 kernels differ by as well (bench/fidelity/fp16_arith.py measures both, on every tiny family). Without AVX512-FP16,
PyTorch's float16 matrix kernels run about 7x slower than its float32 ones (9 against 63 GFLOP/s on 2 threads with
oneDNN held to AVX512_CORE; with AVX512-FP16 they are as fast), so only those are replaced: mm, addmm, bmm, baddbmm,
grouped mm and convolution, when every floating operand is a float16 CPU tensor. Every other op, and every tensor
between ops, stays float16: dtypes, masks, clamps, fp32 islands and overflow are the float16 model's own.
The same mode computes bfloat16 products for a bfloat16 trainer (`Fp32MatrixKernels(torch.bfloat16)`): a GPU's
bfloat16 matrix product is bfloat16 operands, float32 sums and one rounding too, and PyTorch's bfloat16 kernels are
as slow here without AVX512-BF16.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..core.weights import compute_device
from .choices import AUTO, EMULATED, NATIVE  # the option's names, default and check: one place (engine.choices)
from .choices import DEFAULT_FP16_ARITH as DEFAULT  # noqa: F401  (emulated where proven and slow: resolve)
from .choices import FP16_ARITHS as ARITHS  # noqa: F401
from .choices import check_fp16_arith as check_arith

SLOW = 2.0  # float16 products this many times slower than float32 ones make "auto" emulate

# model_type -> why the emulation is not used for it: families where bench/fidelity/fp16_arith.py (and
# tests/test_fp16_arith.py) did not find the emulated logits within two native kernels' difference.
NATIVE_ONLY: dict[str, str] = {}

calls: Counter = Counter()  # matrix products run from float32 kernels, by op name: what runs reached
aten = torch.ops.aten
MATRIX_OPS = frozenset(getattr(aten, op).default for op in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution")
                       if hasattr(aten, op))  # _grouped_mm (fused MoE experts) is newer than torch 2.1


def _cpu_operands_in(dtype: torch.dtype, args, kwargs) -> bool:
    floats = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return bool(floats) and all(a.dtype == dtype and a.device.type == "cpu" for a in floats)


# Operands of at least this many elements are widened into one float32 buffer the mode keeps: a fresh tensor that
# large is memory the process maps anew (glibc maps blocks past 32 MB), and touching its pages costs more than the
# widening (2.9 against 0.9 ns an element, measured); smaller ones come from memory the allocator reuses.
WIDEN_INTO_BUFFER = 1 << 22


def _dense(a: torch.Tensor) -> bool:
    """`a` covers exactly `a.numel()` consecutive elements of memory in some order (a weight, or its transpose)."""
    span = 1
    for stride, size in sorted((st, n) for st, n in zip(a.stride(), a.size()) if n != 1):
        if stride != span:
            return False
        span *= size
    return True


class Fp32MatrixKernels(TorchDispatchMode):
    """For the duration, float16 (or `dtype`'s) matrix products on the CPU run as float32 kernels on the (exact)
    float32 values of their operands, the result rounded once to that dtype. `calls` counts them (what a run reached)."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype
        self.calls = 0
        self.reused = 0  # operands widened into the kept buffer (tests read it)
        self._buffer: torch.Tensor | None = None
        self._lent = False

    def _up(self, a):
        """`a` in float32 (the same values and strides as `a.float()`): a large operand into the kept buffer, which
        one product at a time borrows (the product reads it and returns a new tensor)."""
        if not (isinstance(a, torch.Tensor) and a.dtype == self.dtype):
            return a
        n = a.numel()
        if n < WIDEN_INTO_BUFFER or self._lent or not _dense(a):
            return a.float()
        if self._buffer is None or self._buffer.numel() < n:
            self._buffer = None  # the old one freed before the larger is made
            self._buffer = torch.empty(n, dtype=torch.float32)
        self._lent = True
        self.reused += 1
        return self._buffer[:n].as_strided(a.size(), a.stride()).copy_(a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATRIX_OPS and _cpu_operands_in(self.dtype, args, kwargs):
            self.calls += 1
            calls[func.__name__] += 1
            try:
                out = func(*tree_map(self._up, args), **tree_map(self._up, kwargs))
            finally:
                self._lent = False
            return out.to(self.dtype)
        return func(*args, **kwargs)


def product_seconds(a: torch.Tensor, b: torch.Tensor, tries: int = 3) -> float:
    """The best of `tries` timings of `a @ b`, after one untimed run: how fast this CPU multiplies in their dtype."""
    a @ b
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def float16_products_slowdown(dtype: torch.dtype = torch.float16) -> float:
    """How many times slower PyTorch's float16 (or `dtype`'s) matrix product is than its float32 one on this CPU,
    measured once (best of 3, [128, 1024] x [1024, 512]; about 0.1 s where it is slow): about 1 with AVX512-FP16,
    7 to 100 without."""
    x, w = torch.randn(128, 1024), torch.randn(1024, 512)
    return product_seconds(x.to(dtype), w.to(dtype)) / product_seconds(x, w)


def resolve(asked: str | None, model) -> dict:
    """What the float16 trials of `model` use: {"asked", "used", "why"}. PyTorch's float16 kernels for a model type in
    NATIVE_ONLY (the emulation is not proven there) and on a GPU (float16 is its own speed); "auto" emulates only
    where PyTorch's float16 products are `SLOW`er than float32 ones."""
    asked = check_arith(asked)
    if asked == NATIVE:
        return {"asked": asked, "used": NATIVE, "why": "asked for"}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in NATIVE_ONLY:
        return {"asked": asked, "used": NATIVE, "why": f"{model_type}: {NATIVE_ONLY[model_type]}"}
    if compute_device(model).type != "cpu":
        return {"asked": asked, "used": NATIVE, "why": "the model computes on a GPU, whose float16 kernels are fast"}
    if asked == AUTO:
        # the measured ratio is logged, not recorded: halfsafe.json is the same run to run
        slowdown = float16_products_slowdown()
        logging.getLogger(__name__).info("float16 matrix products take %.2fx float32's time here", slowdown)
        if slowdown < SLOW:
            return {"asked": asked, "used": NATIVE,
                    "why": f"PyTorch's float16 matrix products run at float32 speed here (under {SLOW:g}x its time)"}
        return {"asked": asked, "used": EMULATED,
                "why": f"PyTorch's float16 matrix products take {SLOW:g}x float32's here or more: float32 kernels, rounded once"}
    return {"asked": asked, "used": EMULATED, "why": "asked for: float16 matrix products from float32 kernels, rounded once"}


@contextmanager
def fp16_arith(used: str, dtype: torch.dtype = torch.float16):
    """The arithmetic `used` ("emulated" or "native", as `resolve` says) for the duration, for `dtype`'s products."""
    with Fp32MatrixKernels(dtype) if used == EMULATED else nullcontext() as mode:
        yield mode
