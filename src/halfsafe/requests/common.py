"""What several commands' requests share: the calibration text, the engine, the float16 arithmetic of the trials, the
runtime profile; each with its one default and its one check. Nothing here imports torch: the command line reads
these defaults to build its parser."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.choices import (  # noqa: F401  (the engine's option names, defaults and checks; re-exported)
    AUTO,
    BFLOAT16,
    CALIB_ARITHS,
    DEFAULT_CALIB_ARITH,
    DEFAULT_FP16_ARITH,
    DEFAULT_MAX_SHARD_SIZE,
    EMULATED,
    FLOAT32,
    FP16_ARITHS,
    NATIVE,
    check_calib_arith,
    check_fp16_arith,
)
from ..runtime.profiles import DEFAULT as DEFAULT_RUNTIME
from ..runtime.profiles import PROFILES, RuntimeProfile, get_profile

DEFAULT_MODEL = "gemma3-270m"  # the built-in model: scan's default MODEL, the demo's
TORCH = PROFILES[DEFAULT_RUNTIME]


def runtime_profile(runtime: str | RuntimeProfile | None) -> RuntimeProfile:
    """A --runtime name (None: torch) as its profile: the one place a name becomes a profile."""
    return get_profile(runtime)


@dataclass(frozen=True)
class TextOptions:
    """The text a command cuts its samples from, and how: `texts` (halfsafe.calibration.read_texts' results; None:
    the command's embedded text), samples of `seq_len` tokens, at most `max_samples` of them (None: as many as the
    text holds), the tokenizer from the folder `tokenizer` (None: the model's own)."""

    texts: tuple | None = None
    seq_len: int = 512
    max_samples: int | None = 8
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.texts is not None and not isinstance(self.texts, tuple):
            object.__setattr__(self, "texts", tuple(self.texts))  # a list given is kept as it was, unchangeable

    @property
    def text_list(self) -> list | None:
        """The texts as the sample cutter takes them."""
        return None if self.texts is None else list(self.texts)


@dataclass(frozen=True)
class EngineOptions:
    """How the model runs: block by block from its shards (`stream`, halfsafe.engine) where its layout allows, or
    whole in memory; on `device` ("auto": cuda when torch sees a GPU)."""

    stream: bool = True
    device: str = "auto"


@dataclass(frozen=True)
class Fp16Options:
    """The float16 arithmetic a command runs under: the runtime profile whose float16 it measures or emulates (the
    profile, never a name: resolved by `checked`) and how the float16 trials compute (halfsafe.engine.fp16_arith)."""

    runtime: RuntimeProfile = TORCH
    fp16_arith: str = DEFAULT_FP16_ARITH  # None given: the default

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, RuntimeProfile):
            raise TypeError(f"runtime is a RuntimeProfile, not {type(self.runtime).__name__}: use Fp16Options.checked")
        object.__setattr__(self, "fp16_arith", check_fp16_arith(self.fp16_arith))

    @classmethod
    def checked(cls, runtime: str | RuntimeProfile | None = None, fp16_arith: str | None = None) -> "Fp16Options":
        return cls(runtime_profile(runtime), fp16_arith)
