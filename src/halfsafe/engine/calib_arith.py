"""How the calibration's matrix products compute (`--calib-arith`): float32, or bfloat16 operands where this CPU
multiplies bfloat16 fast.

The calibration (`scan.collect`: every site's |x| max over the calibration samples) decides the plan only through
the power of two each peak sits under, so it needs the peaks' sizes, not their last bits. With "bfloat16" the model
stays float32 and every op but the matrix products computes as before (norms, softmax, residual adds, the hooks'
statistics); only float32 CPU products (mm, addmm, bmm, baddbmm, grouped mm: linear layers, attention's products,
the head) multiply their operands rounded to bfloat16, accumulate in float32 inside the kernel and give float32
back, rounded once to bfloat16 on the way (PyTorch's CPU bfloat16 product returns bfloat16). A bfloat16-pretrained
model's weights are bfloat16 already, so what is rounded is the activations going in and the products coming out:
2^-9 relative each, a peak moves by well under `PEAK_RTOL` (tests/test_calib_arith.py measures every tiny family).
Convert then keeps the float32 plan by checking that its decisions hold for every peak within `PEAK_RTOL`
(halfsafe.convert), and measures again in float32 where one does not.

Where the CPU has AVX512-BF16 or AMX, PyTorch's (oneDNN's) bfloat16 products run faster than float32 ones (2.2x on
one thread of an AMD EPYC with AVX512-BF16, about 4x on two; more with AMX); without them they run slower (a
bfloat16 product is then emulated in float32, plus the conversions), so "auto" measures once on this machine
(`bfloat16_products_speedup`) and takes bfloat16 only where it is `FAST`er. What it chose and why is recorded in
halfsafe.json; the measured speed is logged, never recorded.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict
from contextlib import contextmanager, nullcontext

import torch
from greenlet import getcurrent
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.weights import compute_device
from .choices import AUTO, BFLOAT16, FLOAT32
from .choices import CALIB_ARITHS as ARITHS  # noqa: F401
from .choices import DEFAULT_CALIB_ARITH as DEFAULT  # noqa: F401
from .choices import check_calib_arith as check_arith
from .fp16_arith import product_seconds

FAST = 1.5  # bfloat16 products this many times faster than float32 ones make "auto" take bfloat16
PEAK_RTOL = 2.0 ** -5  # a peak from bfloat16 products is within this relative distance of float32's (module docstring)
# bfloat16 copies of weights kept while the mode is on: a block's up to 1.2B (2048 wide: 102 MB), the head's its
# chunks share (32000 x 2048: 131 MB). Each entry also keeps its float32 source alive until it is evicted (a block
# after the pass has left it): at most this in bfloat16 plus twice as much in float32, only where bfloat16 is chosen.
CACHE_BYTES = 128 << 20

# runs (greenlets: engine.pipeline runs each forward of a pass as one) whose products stay float32 under the mode:
# convert's float32 reference logits, computed beside a bfloat16 calibration in the same read (`float32_products`)
_exempt: set = set()

aten = torch.ops.aten
PRODUCTS = {getattr(aten, op).default: op for op in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm") if hasattr(aten, op)}


def _float32_cpu(args, kwargs) -> bool:
    floats = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return bool(floats) and all(a.dtype == torch.float32 and a.device.type == "cpu" for a in floats)


class Bf16MatrixKernels(TorchDispatchMode):
    """For the duration, float32 matrix products on the CPU multiply bfloat16 roundings of their operands; the
    result comes back float32 and the bias (addmm, baddbmm) is added in float32. A product's right operand (a linear
    layer's weight, as F.linear and GPT-2's Conv1D call it) is rounded once and kept while it is unchanged
    (`CACHE_BYTES`): the samples running in step (engine.pipeline) reuse each weight of a block, the head's chunks
    its weight. `calls` counts the products run."""

    def __init__(self, cache_bytes: int = CACHE_BYTES) -> None:
        super().__init__()
        self.calls = 0
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple, tuple[weakref.ref, torch.Tensor]] = OrderedDict()  # key -> (source, bf16)
        self._held = 0

    def _weight(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in bfloat16, from the cache when `t` (its storage, place, shape and version) was rounded before. An
        entry lives as long as the tensor `t` views (a layer's weight, for `W.t()`), no longer: the cache holds it
        weakly, so a streamed block's float32 weights are freed when the block is done (and its memory, reused by
        another tensor, can never be taken for the old one's)."""
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None:
            self._cache.move_to_end(key)
            return hit[1]
        self._drop(key)
        b = t.to(torch.bfloat16)
        size = b.numel() * b.element_size()
        if size <= self.cache_bytes:
            while self._cache and self._held + size > self.cache_bytes:
                self._drop(next(iter(self._cache)))
            source = t._base if t._base is not None else t
            self._cache[key] = (weakref.ref(source, lambda _, key=key: self._drop(key)), b)
            self._held += size
        return b

    def _drop(self, key: tuple) -> None:
        entry = self._cache.pop(key, None)
        if entry is not None:
            self._held -= entry[1].numel() * entry[1].element_size()

    def clear(self) -> None:
        self._cache.clear()
        self._held = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = PRODUCTS.get(func)
        if op is None or not _float32_cpu(args, kwargs) or (_exempt and getcurrent() in _exempt):
            return func(*args, **kwargs)
        self.calls += 1
        if op in ("mm", "bmm"):
            a, b = args[:2]
            return func(a.to(torch.bfloat16), self._weight(b) if op == "mm" else b.to(torch.bfloat16)).float()
        if op in ("addmm", "baddbmm"):
            bias, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            prod = (aten.mm.default(a.to(torch.bfloat16), self._weight(b)) if op == "addmm"
                    else aten.bmm.default(a.to(torch.bfloat16), b.to(torch.bfloat16))).float()
            if alpha != 1:
                prod = prod.mul_(alpha)
            return prod.add_(bias) if beta == 1 else (prod.add_(bias, alpha=beta) if beta != 0 else prod)
        # grouped mm (fused experts): every float operand rounded, the result widened
        up = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return func(*up, **kwargs).float()


@functools.cache
def bfloat16_products_speedup() -> float:
    """How many times faster PyTorch's bfloat16 matrix product is than its float32 one on this CPU, measured once
    (best of 3, [256, 1024] x [1024, 1024]; well under a second): 2 to 4 with AVX512-BF16, more with AMX, under 1
    without."""
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024)
    return product_seconds(x, w) / product_seconds(x.bfloat16(), w.bfloat16())


def resolve(asked: str | None, model) -> dict:
    """How the calibration of `model` multiplies: {"asked", "used", "why"}. float32 on a GPU (the mode rounds CPU
    products only); "auto" takes bfloat16 only where its products are `FAST`er than float32's on this CPU."""
    asked = check_arith(asked)
    if asked == FLOAT32:
        return {"asked": asked, "used": FLOAT32, "why": "asked for"}
    if compute_device(model).type != "cpu":
        return {"asked": asked, "used": FLOAT32, "why": "the model computes on a GPU: its products are not rounded to bfloat16"}
    if asked == AUTO:
        speedup = bfloat16_products_speedup()  # logged, not recorded: halfsafe.json is the same run to run
        logging.getLogger(__name__).info("bfloat16 matrix products run %.2fx float32's speed here", speedup)
        if speedup < FAST:
            return {"asked": asked, "used": FLOAT32,
                    "why": f"bfloat16 matrix products are not {FAST:g}x faster than float32's on this CPU"}
        return {"asked": asked, "used": BFLOAT16,
                "why": f"bfloat16 matrix products run {FAST:g}x float32's speed here or more: operands rounded to bfloat16, "
                       "peaks kept within their difference"}
    return {"asked": asked, "used": BFLOAT16, "why": "asked for: operands rounded to bfloat16, peaks kept within their difference"}


@contextmanager
def calib_arith(used: str):
    """The arithmetic `used` ("float32" or "bfloat16", as `resolve` says) for the duration."""
    mode = Bf16MatrixKernels() if used == BFLOAT16 else None
    with mode if mode is not None else nullcontext():
        try:
            yield mode
        finally:
            if mode is not None:
                mode.clear()


@contextmanager
def float32_products():
    """Within, this run's (greenlet's) products compute in float32 under any `Bf16MatrixKernels`: a forward run beside
    a bfloat16 calibration (engine.pipeline) computes exactly what it computes alone in float32."""
    me = getcurrent()
    if me in _exempt:
        yield
        return
    _exempt.add(me)
    try:
        yield
    finally:
        _exempt.discard(me)
