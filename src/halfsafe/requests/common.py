"""What several commands' requests share: the calibration text, the engine, the float16 arithmetic of the trials, the
runtime profile; each with its one default and its one check. Nothing here imports torch: the command line reads
these defaults to build its parser."""

from __future__ import annotations

import numbers
import os
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
from ..errors import HalfsafeError
from ..runtime.profiles import DEFAULT as DEFAULT_RUNTIME
from ..runtime.profiles import PROFILES, RuntimeProfile, get_profile

DEFAULT_MODEL = "gemma3-270m"  # the built-in model: scan's default MODEL, the demo's
TORCH = PROFILES[DEFAULT_RUNTIME]


# The checks every request runs on its fields, built from the command line or directly in Python: a value of the wrong
# type is a one-line error naming the option, never a TypeError from deep inside the run (a bool is not a number).
def whole(flag: str, value, least: int | None = None, optional: bool = False) -> None:
    """`value` is an integer (None where `optional`), at least `least` where given."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise HalfsafeError(f"{flag} {value!r:.60} is not a whole number: pass e.g. {flag} {max(least or 0, 1)}")
    if least is not None and value < least:
        raise HalfsafeError(f"{flag} {value!r} must be at least {least}")


def real(flag: str, value, optional: bool = False) -> None:
    """`value` is a number (None where `optional`); its range is the caller's to check."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HalfsafeError(f"{flag} {value!r:.60} is not a number")


def switch(name: str, value) -> None:
    if not isinstance(value, bool):
        raise HalfsafeError(f"{name}={value!r:.60}: pass True or False")


def path(name: str, value, optional: bool = False) -> None:
    """A folder or file named by a string or a path (None where `optional`)."""
    if not (value is None and optional) and (isinstance(value, bool) or not isinstance(value, (str, os.PathLike))):
        raise HalfsafeError(f"{name} {value!r:.60} is not a path: pass a folder as a string or a pathlib.Path")


def device(value) -> None:
    """A --device name, or a torch.device (engine.device resolves either where the model loads)."""
    if not (isinstance(value, str) or (type(value).__module__, type(value).__name__) == ("torch", "device")):
        raise HalfsafeError(f"--device {value!r:.60}: pass auto, cpu, cuda or cuda:N")


def instance(name: str, value, kind: type, hint: str = "") -> None:
    if not isinstance(value, kind):
        raise HalfsafeError(f"{name} is a {kind.__name__}, not {type(value).__name__}{hint}")


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
        if self.texts is not None:
            if isinstance(self.texts, (str, bytes)) or not isinstance(self.texts, (list, tuple)) or \
                    not all(isinstance(t, str) or callable(getattr(t, "blank", None)) for t in self.texts):
                raise HalfsafeError(f"texts {self.texts!r:.60}: pass a list of strings (or read_texts' files)")
            object.__setattr__(self, "texts", tuple(self.texts))  # a list given is kept as it was, unchangeable
        whole("--seq-len", self.seq_len)
        if self.seq_len < 2:
            raise HalfsafeError(f"--seq-len {self.seq_len} is too short: use at least 2")
        whole("--max-samples", self.max_samples, 0, optional=True)
        path("--tokenizer", self.tokenizer, optional=True)

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

    def __post_init__(self) -> None:
        switch("stream", self.stream)
        device(self.device)


@dataclass(frozen=True)
class Fp16Options:
    """The float16 arithmetic a command runs under: the runtime profile whose float16 it measures or emulates (the
    profile, never a name: resolved by `checked`) and how the float16 trials compute (halfsafe.engine.fp16_arith)."""

    runtime: RuntimeProfile = TORCH
    fp16_arith: str = DEFAULT_FP16_ARITH  # None given: the default

    def __post_init__(self) -> None:
        instance("runtime", self.runtime, RuntimeProfile, ": use Fp16Options.checked")
        object.__setattr__(self, "fp16_arith", check_fp16_arith(self.fp16_arith))

    @classmethod
    def checked(cls, runtime: str | RuntimeProfile | None = None, fp16_arith: str | None = None) -> "Fp16Options":
        return cls(runtime_profile(runtime), fp16_arith)
