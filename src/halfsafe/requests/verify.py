"""`halfsafe verify` as a request: typed and checked once, before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import HalfsafeError
from ..runtime.profiles import RuntimeProfile
from .common import EngineOptions, Fp16Options, TextOptions, instance, whole

VERIFY_TEXT = TextOptions(seq_len=512, max_samples=2)  # held-out text: the embedded one unless texts are given
GREEDY_TOKENS = 32  # tokens generated greedily from the start of each text (0: none)
PROMPT_TOKENS = 16  # ... from this many of its first tokens


@dataclass(frozen=True)
class VerifyRequest:
    """`halfsafe verify MODEL [CONVERTED]`. `model` and `converted`: folders, fixture names or hub ids, or (from
    Python) models; `tokenizer`: a tokenizer object for a model given as one; `text.tokenizer`: a folder to take the
    tokenizer from where `model` is loaded here. `variants`: a subset of verify.ALL_VARIANTS (None: all)."""

    model: Any
    converted: Any = None
    text: TextOptions = VERIFY_TEXT
    text_names: tuple[str, ...] | None = None
    tokenizer: Any = None
    greedy_tokens: int = GREEDY_TOKENS
    prompt_tokens: int = PROMPT_TOKENS
    variants: tuple[str, ...] | None = None
    engine: EngineOptions = field(default_factory=EngineOptions)
    fp16: Fp16Options = field(default_factory=Fp16Options)
    progress: Callable[[str], None] | None = None  # called with a short status line

    def __post_init__(self) -> None:
        for name in ("text_names", "variants"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
                        not all(isinstance(v, str) for v in value):
                    raise HalfsafeError(f"{name} {value!r:.60}: pass a list of names")
                object.__setattr__(self, name, tuple(value))
        instance("text", self.text, TextOptions)
        whole("--greedy-tokens", self.greedy_tokens, 0)
        whole("prompt_tokens", self.prompt_tokens, 1)
        instance("engine", self.engine, EngineOptions)
        instance("fp16", self.fp16, Fp16Options, ": use Fp16Options.checked")
        if self.progress is not None and not callable(self.progress):
            raise HalfsafeError(f"progress {self.progress!r:.60}: pass a function of one string, or None")
        if self.text.texts is not None and self.text_names is not None and len(self.text_names) != len(self.text.texts):
            raise HalfsafeError("give one name per text")

    @property
    def runtime(self) -> RuntimeProfile:
        return self.fp16.runtime
