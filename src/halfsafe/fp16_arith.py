"""How the float16 trials compute (convert's candidates, `scan --fp16-check`, verify's float16 variants):
PyTorch's own float16 kernels ("native"), or the same arithmetic from float32 matrix kernels ("emulated").

PyTorch's CPU float16 ops take and give float16 tensors and compute inside in float32: a matrix product multiplies
float16 operands exactly in float32, accumulates in float32 and rounds its result once to float16. A float32 kernel
on the same operands followed by that one rounding computes the same, up to the order of the float32 sums: what two
float16 kernels differ by as well (bench/fp16_arith.py measures both, on every tiny family). Without AVX512-FP16
PyTorch's float16 matrix kernels run about 7x slower than its float32 ones (9 against 63 GFLOP/s on 2 threads,
measured with oneDNN held to AVX512_CORE), so only those are replaced: mm, addmm, bmm, baddbmm, grouped mm and
convolution, when every floating operand is a float16 CPU tensor. Every other op, and every tensor between ops,
stays float16: dtypes, masks, clamps, fp32 islands and overflow are the float16 model's own.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .errors import HalfsafeError

EMULATED, NATIVE = "emulated", "native"
ARITHS = (EMULATED, NATIVE)
DEFAULT = EMULATED

# model_type -> why the emulation is not used for it: families where bench/fp16_arith.py (and
# tests/test_fp16_arith.py) did not find the emulated logits within two native kernels' difference.
NATIVE_ONLY: dict[str, str] = {}

calls: Counter = Counter()  # matrix products run from float32 kernels, by op name: what runs reached
aten = torch.ops.aten
MATRIX_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                        aten._grouped_mm.default, aten.convolution.default})


def _half_cpu_operands(args, kwargs) -> bool:
    floats = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return bool(floats) and all(a.dtype == torch.float16 and a.device.type == "cpu" for a in floats)


def _up(a):
    return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float16 else a


class Fp32MatrixKernels(TorchDispatchMode):
    """For the duration, float16 matrix products on the CPU run as float32 kernels on the (exact) float32 values
    of their operands, the result rounded once to float16. `calls` counts them (what a run reached)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATRIX_OPS and _half_cpu_operands(args, kwargs):
            self.calls += 1
            calls[func.__name__] += 1
            out = func(*tree_map(_up, args), **tree_map(_up, kwargs))
            return out.to(torch.float16)
        return func(*args, **kwargs)


def check_arith(asked: str | None) -> str:
    """The option as given (None: the default); an unknown name is a one-line error."""
    asked = DEFAULT if asked is None else asked
    if asked not in ARITHS:
        raise HalfsafeError(f"unknown --fp16-arith {asked!r}: use {' or '.join(ARITHS)}")
    return asked


def resolve(asked: str | None, model) -> dict:
    """What the float16 trials of `model` use: {"asked", "used", "why"}. Emulated where asked and proven: a model
    type in NATIVE_ONLY keeps PyTorch's float16 kernels, and so does a model on a GPU (float16 is its own speed)."""
    from .engine.streamed import compute_device

    asked = check_arith(asked)
    if asked == NATIVE:
        return {"asked": asked, "used": NATIVE, "why": "asked for"}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in NATIVE_ONLY:
        return {"asked": asked, "used": NATIVE, "why": f"{model_type}: {NATIVE_ONLY[model_type]}"}
    if compute_device(model).type != "cpu":
        return {"asked": asked, "used": NATIVE, "why": "the model computes on a GPU, whose float16 kernels are fast"}
    return {"asked": asked, "used": EMULATED, "why": "float16 matrix products from float32 kernels, rounded once"}


@contextmanager
def fp16_arith(used: str):
    """The arithmetic `used` ("emulated" or "native", as `resolve` says) for the duration."""
    with Fp32MatrixKernels() if used == EMULATED else nullcontext() as mode:
        yield mode
