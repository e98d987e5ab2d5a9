"""`halfsafe convert` and `halfsafe apply` as requests: every option typed and checked once, before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..errors import HalfsafeError
from ..runtime.profiles import RuntimeProfile, SplitK
from .common import (
    DEFAULT_CALIB_ARITH,
    DEFAULT_MAX_SHARD_SIZE,
    EngineOptions,
    Fp16Options,
    TextOptions,
    check_calib_arith,
    instance,
    path,
    switch,
    whole,
)
from .margin import MarginOptions

CONVERT_TEXT = TextOptions(seq_len=512, max_samples=8)
APPLY_TEXT = TextOptions(seq_len=256, max_samples=2)  # a brief scan of the result
CANDIDATES = 3  # residual scales measured in float16 at most (besides those above the margin's)
TARGETS = ("onnx", "gguf")  # convert --to


@dataclass(frozen=True)
class PlanOptions:
    """What choosing a plan takes (halfsafe.convert.plan_with): the margin, whether a plan that leaves activations
    above 65504 may be saved, how many residual scales are measured, the float16 arithmetic it is chosen under, and
    how the calibration's matrix products compute (`calib_arith`, halfsafe.engine.calib_arith: auto, float32 or
    bfloat16)."""

    margin: MarginOptions = field(default_factory=MarginOptions)
    allow_unfixable: bool = False
    candidates: int = CANDIDATES
    fp16: Fp16Options = field(default_factory=Fp16Options)
    calib_arith: str | None = DEFAULT_CALIB_ARITH  # None: the default (__post_init__ checks and fills it)

    def __post_init__(self) -> None:
        instance("margin", self.margin, MarginOptions)
        switch("allow_unfixable", self.allow_unfixable)
        whole("candidates", self.candidates, 1)
        instance("fp16", self.fp16, Fp16Options, ": use PlanOptions.checked")
        object.__setattr__(self, "calib_arith", check_calib_arith(self.calib_arith))

    @property
    def runtime(self) -> RuntimeProfile:
        return self.fp16.runtime

    @classmethod
    def checked(cls, headroom_bits: float | None = None, max_context: int | None = None, allow_unfixable: bool = False,
                candidates: int = CANDIDATES, runtime: str | RuntimeProfile | None = None,
                fp16_arith: str | None = None, calib_arith: str | None = None) -> "PlanOptions":
        return cls(MarginOptions(max_context, headroom_bits), allow_unfixable, candidates, Fp16Options.checked(runtime, fp16_arith),
                   calib_arith)  # checked (None: the default) in __post_init__


@dataclass(frozen=True)
class ConvertRequest:
    """`halfsafe convert MODEL OUT`: `plan.runtime` is the profile asked for (--runtime); with `to="onnx"` the
    checkpoint is chosen under what the graph leaves to it (`checkpoint_runtime`) and the graph exported under the
    whole profile (`export_runtime`)."""

    source: str | os.PathLike
    out: str | os.PathLike
    text: TextOptions = CONVERT_TEXT
    plan: PlanOptions = field(default_factory=PlanOptions)
    long_sample: int | None = None  # also calibrate on one sample of this many tokens (the embedded text repeated)
    overwrite: bool = False
    progress: bool = True
    engine: EngineOptions = field(default_factory=EngineOptions)
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE  # "5GB", "500MiB" or bytes (io.checkpoint.shard_size)
    to: str | None = None  # "onnx": also an fp16 ONNX model inside OUT
    split_k: SplitK | None = None  # --to onnx: how the graph's products are split (None: profiles.export_profile's)

    def __post_init__(self) -> None:
        _common(self, ("source", "out"))
        instance("plan", self.plan, PlanOptions)
        whole("--long-sample", self.long_sample, optional=True)
        if self.long_sample is not None and self.long_sample < 2:
            raise HalfsafeError(f"--long-sample {self.long_sample} is too short: use at least 2 tokens")
        if isinstance(self.max_shard_size, bool) or not isinstance(self.max_shard_size, (int, str)):
            raise HalfsafeError(f"--max-shard-size {self.max_shard_size!r:.60} is not a size: give e.g. 5GB, 500MB or a number of bytes")
        if self.to is not None and not (isinstance(self.to, str) and self.to in TARGETS):
            raise HalfsafeError(f"--to {self.to!r:.60}: choose one of {', '.join(TARGETS)}")
        if self.split_k is not None:
            instance("split_k", self.split_k, SplitK, ": pass halfsafe.runtime.profiles.SplitK.parse(text)")
            if self.to != "onnx":
                raise HalfsafeError("--split-k is for --to onnx: it says how the ONNX graph's matrix products are split")

    @property
    def export_runtime(self) -> RuntimeProfile:
        """The profile the ONNX graph is exported under (--to onnx): the one asked for."""
        return self.plan.runtime

    @property
    def checkpoint_runtime(self) -> RuntimeProfile:
        """The profile the checkpoint must meet: with --to onnx the graph prescales its norms, the checkpoint meets
        the rest of the profile's float16 arithmetic."""
        return self.plan.runtime.without_norm_stats() if self.to == "onnx" else self.plan.runtime

    @property
    def checkpoint_plan(self) -> PlanOptions:
        """`plan` under `checkpoint_runtime`."""
        if self.checkpoint_runtime is self.plan.runtime:
            return self.plan
        return replace(self.plan, fp16=replace(self.plan.fp16, runtime=self.checkpoint_runtime))


@dataclass(frozen=True)
class ApplyRequest:
    """`halfsafe apply PLAN MODEL OUT`: a saved plan re-applied to another checkpoint of the same architecture."""

    plan_path: str | os.PathLike
    source: str | os.PathLike
    out: str | os.PathLike
    text: TextOptions = APPLY_TEXT
    overwrite: bool = False
    progress: bool = True
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        _common(self, ("plan_path", "source", "out"))


def _common(request, paths: tuple[str, ...]) -> None:
    """The fields convert and apply share: their paths, text, switches and engine."""
    for name in paths:
        path(name, getattr(request, name))
    instance("text", request.text, TextOptions)
    switch("overwrite", request.overwrite)
    switch("progress", request.progress)
    instance("engine", request.engine, EngineOptions)
