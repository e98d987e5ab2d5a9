"""halfsafe's fp16 trials must run the model a user gets from `from_pretrained(..., dtype=torch.float16)`."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY, make_tiny

from halfsafe.engine.precision import cast_copy
from halfsafe.runtime.fp16 import load_pure_fp16


@pytest.mark.parametrize("key", sorted(TINY))
def test_cast_copy_matches_from_pretrained_dtypes(key, tmp_path):
    model = make_tiny(key)
    model.save_pretrained(tmp_path)
    # T5 keeps `wo` in fp32 under plain from_pretrained; a converted T5 is meant to load all-fp16
    fp32_wo = bool(getattr(type(model), "_keep_in_fp32_modules", None))
    loaded = (load_pure_fp16(type(model), tmp_path) if fp32_wo else type(model).from_pretrained(tmp_path, dtype=torch.float16))
    copy = cast_copy(model, torch.float16)
    want = {n: b.dtype for n, b in loaded.named_buffers()} | {n: p.dtype for n, p in loaded.named_parameters()}
    got = {n: b.dtype for n, b in copy.named_buffers()} | {n: p.dtype for n, p in copy.named_parameters()}
    assert got == want
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original is untouched
