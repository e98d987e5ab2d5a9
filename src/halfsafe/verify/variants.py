"""The ways of running a model that `verify` compares, as data.

A variant is a weight dtype, where the weights come from (the original or the converted checkpoint) and the
run-time patch it needs; `verify` builds and runs each from these fields alone, so a new variant is one entry
in VARIANTS.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from ..runtime.baselines import RuntimeHandle, clamp_residual_adds, keep_residual_fp32
from ..runtime.emulate import emulate_runtime

REFERENCE = "fp32"
BF16, FP16, CLAMP, FP32_RESIDUAL = "bf16", "fp16", "fp16 clamp", "fp16 + fp32 residual"
HALFSAFE, HALFSAFE_FP32_RESIDUAL = "halfsafe fp16", "halfsafe fp16 + fp32 residual"
BASELINES = (BF16, FP16, CLAMP, FP32_RESIDUAL)
CONVERTED = (HALFSAFE, HALFSAFE_FP32_RESIDUAL)
ALL_VARIANTS = (REFERENCE, *BASELINES, *CONVERTED)

Patch = Callable[[nn.Module], AbstractContextManager]  # put on before the run, taken off by leaving the `with`


def plain(model: nn.Module) -> RuntimeHandle:
    """No patch: the model as plain transformers runs it."""
    return RuntimeHandle()


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str  # weight dtype
    converted: bool  # weights from the converted checkpoint (else the original's)
    description: str
    patch: Patch = plain  # may raise HalfsafeError where it does not apply to a model

    @property
    def custom_runtime(self) -> bool:
        """Needs code beyond plain transformers at run time."""
        return self.patch is not plain

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "custom_runtime": self.custom_runtime, "converted": self.converted,
                "description": self.description}


VARIANTS = {
    REFERENCE: Variant(REFERENCE, "float32", False, "the original in float32: the reference"),
    BF16: Variant(BF16, "bfloat16", False, "the original cast to bfloat16"),
    FP16: Variant(FP16, "float16", False, "the original cast to float16"),
    CLAMP: Variant(CLAMP, "float16", False, "float16, each residual add clamped to +-32752 (fp16 ONNX exports of Gemma 3)",
                   clamp_residual_adds),
    FP32_RESIDUAL: Variant(FP32_RESIDUAL, "float16", False, "float16 weights and matmuls, residual stream in float32",
                           keep_residual_fp32),
    HALFSAFE: Variant(HALFSAFE, "float16", True, "the halfsafe-converted checkpoint in float16"),
    HALFSAFE_FP32_RESIDUAL: Variant(HALFSAFE_FP32_RESIDUAL, "float16", True, "the converted checkpoint, residual stream in float32",
                                    keep_residual_fp32),
}


def under_runtime(base: Variant, profile) -> Variant:
    """`base` run under a runtime profile's float16 arithmetic (halfsafe.runtime.emulate): "<base> @ <profile>"."""
    return Variant(f"{base.name} @ {profile.name}", base.dtype, base.converted,
                   f"{base.description}, under runtime profile {profile.name}: {profile.summary} (emulated)",
                   partial(emulate_runtime, profile=profile))
