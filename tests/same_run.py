"""How close two runs of the same model on the same ops and layouts must be: the streamed and the whole model.

On this project's Intel machines they are bit-identical for every tiny family, at 1 and 2 threads, also with every
weight misaligned by one element. The matrix library does not promise that on every CPU: on an AMD EPYC machine
gemma4_text-moe's streamed and whole fp32 logits differed in 669 of 3072 entries by at most 1.6e-7, 2.3 units in
the last place (ulp) of the logits' peak (0.574), with one thread too. So the bound is in ulps of the peak: 8 in
float32 (3x that measurement); in float16 8 fp16 ulps of the peak, room for a last-bit float32 difference to flip
the rounding of an fp16 activation and carry through the blocks after it (not measured on such a CPU)."""

from __future__ import annotations

import torch

ULPS = 8


def assert_same_run(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.isfinite(a).all() == torch.isfinite(b).all(), what
    if torch.equal(a, b):
        return
    peak = float(a.float().abs().max())
    bound = ULPS * torch.finfo(a.dtype).eps * peak
    diff = float((a.float() - b.float()).abs().max())
    assert diff <= bound, f"{what}: runs differ by {diff:.3g}, more than {ULPS} ulps of the peak {peak:.3g} ({bound:.3g})"
