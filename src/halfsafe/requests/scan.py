"""`halfsafe scan` as a request, and what a scan measures (`ScanOptions`), typed and checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..runtime.profiles import RuntimeProfile
from .common import DEFAULT_MODEL, FLOAT32, EngineOptions, Fp16Options, TextOptions, check_calib_arith, instance, path, switch

SCAN_TEXT = TextOptions(seq_len=512, max_samples=8)
TOP = 12  # rows in the tightest-tensors table


@dataclass(frozen=True)
class ScanOptions:
    """What a scan measures besides the float32 activations: `fp16.runtime`'s float16 quantities (none for torch),
    and with `fp16_check` a float16 run computed as `fp16.fp16_arith` says. `calib_arith`: how the activations'
    matrix products compute (halfsafe.engine.calib_arith; `halfsafe scan` measures in float32, convert's calibration
    as its --calib-arith chose)."""

    fp16_check: bool = False
    fp16: Fp16Options = field(default_factory=Fp16Options)
    calib_arith: str = FLOAT32

    def __post_init__(self) -> None:
        switch("fp16_check", self.fp16_check)
        instance("fp16", self.fp16, Fp16Options, ": use ScanOptions.checked")
        object.__setattr__(self, "calib_arith", check_calib_arith(self.calib_arith))

    @property
    def runtime(self) -> RuntimeProfile:
        return self.fp16.runtime

    @classmethod
    def checked(cls, fp16_check: bool = False, runtime: str | RuntimeProfile | None = None,
                fp16_arith: str | None = None) -> "ScanOptions":
        return cls(fp16_check, Fp16Options.checked(runtime, fp16_arith))


@dataclass(frozen=True)
class ScanRequest:
    """`halfsafe scan MODEL`."""

    model: str | os.PathLike = DEFAULT_MODEL
    text: TextOptions = SCAN_TEXT
    options: ScanOptions = field(default_factory=ScanOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    progress: bool = True

    def __post_init__(self) -> None:
        path("model", self.model)
        instance("text", self.text, TextOptions)
        instance("options", self.options, ScanOptions)
        instance("engine", self.engine, EngineOptions)
        switch("progress", self.progress)
