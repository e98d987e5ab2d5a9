"""Where models compute: `--device cpu|cuda|auto`."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import HalfsafeError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: "str | torch.device" = "auto") -> str:
    """"auto": the GPU when torch sees one, else the CPU. "cuda" without a GPU is a one-line error. A torch.device
    is taken by its name."""
    device = str(device)
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise HalfsafeError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise HalfsafeError(f"--device {device}: torch sees no CUDA GPU here (torch {torch.__version__}); use --device cpu "
                            "or install a CUDA build of torch")
    return str(device)


@contextmanager
def exact_fp16_reductions():
    """fp16 matmuls on CUDA may reduce in fp16 by default (cuBLAS); an fp16 trial must see what a careful runtime
    computes, so reductions stay fp32 for the duration (no effect on CPU)."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction = saved


def return_freed_memory() -> None:
    """Hand memory freed by Python and torch back to the system now (glibc keeps freed blocks for reuse: after
    dropping Gemma 3's tokenizer 0.15 GB of its 0.33 GB stayed resident until trimmed). A no-op elsewhere."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
