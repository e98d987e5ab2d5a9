"""`halfsafe finetune` as a request, with the fine-tune's own settings (`FinetuneConfig`): checked once, before
anything loads."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..errors import HalfsafeError
from .common import TextOptions, device, instance, path, real, switch, whole
from .convert import PlanOptions
from .margin import MarginOptions

FINETUNE_TEXT = TextOptions(seq_len=256, max_samples=8)
TRAIN_MODES = ("parent", "blocks", "all")
HINGE_BITS_UNDER_TARGET = 0.25
FP16_MAX = 65504.0  # float16's largest finite value (halfsafe.core.formats)


@dataclass
class FinetuneConfig:
    steps: int = 500  # at most this many optimizer steps (one sample each)
    threshold: float = 16384.0  # every watched |x| must end below this (2 bits under 65504)
    margin_bits: float = 0.25  # ... with this margin: the hinge acts above threshold * 2**-margin_bits
    lr: float = 3e-2  # relative: a tensor moves by about lr x its RMS per step
    penalty_weight: float = 1.0
    polish_steps: int = 50  # steps after the target is first reached, for the KL to recover
    train: str = "parent"  # what trains: the module around each watched site, its whole block, or "all"
    save_every: int = 10  # optimizer steps between training-state saves (with a state file)
    seed: int = 0
    headroom_bits: float = 2.0  # the exact rescale that runs first (finetune_checkpoint)

    @property
    def target(self) -> float:
        return self.threshold * 2.0 ** -self.margin_bits

    @property
    def hinge(self) -> float:
        return self.target * 2.0 ** -HINGE_BITS_UNDER_TARGET

    def check(self) -> None:
        for flag in ("steps", "polish_steps", "save_every", "seed"):
            whole("--" + flag.replace("_", "-"), getattr(self, flag))
        for flag in ("threshold", "margin_bits", "lr", "penalty_weight", "headroom_bits"):
            real("--" + flag.replace("_", "-"), getattr(self, flag))
        if self.steps < 1:
            raise HalfsafeError(f"--steps {self.steps} is not a positive number of steps: use e.g. --steps 200")
        if not (0 < self.threshold <= FP16_MAX):
            raise HalfsafeError(f"--threshold {self.threshold:g} must lie in (0, 65504]: activations must end below float16's maximum")
        if not (0 <= self.margin_bits < 16):
            raise HalfsafeError(f"--margin-bits {self.margin_bits:g} must lie in [0, 16)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise HalfsafeError(f"--lr {self.lr:g} must be a positive number (a relative step, e.g. 0.01)")
        if not (self.penalty_weight > 0):
            raise HalfsafeError(f"--penalty-weight {self.penalty_weight:g} must be positive")
        if not (isinstance(self.train, str) and self.train in TRAIN_MODES):
            raise HalfsafeError(f"--train {self.train!r:.60}: choose one of {', '.join(TRAIN_MODES)}")
        if self.polish_steps < 0:
            raise HalfsafeError(f"--polish-steps {self.polish_steps} must be 0 or more")
        if self.save_every < 1:
            raise HalfsafeError(f"--save-every {self.save_every} must be at least 1")


@dataclass(frozen=True)
class FinetuneRequest:
    """`halfsafe finetune MODEL OUT`: the exact rescale first (`plan`), then the fine-tune (`config`). Training holds
    every weight: the model is never streamed, only its `device` is chosen."""

    source: str | os.PathLike
    out: str | os.PathLike
    text: TextOptions = FINETUNE_TEXT
    config: FinetuneConfig = field(default_factory=FinetuneConfig)
    overwrite: bool = False
    restart: bool = False  # discard a saved training state
    resume_from: str | None = None  # a state file to continue from instead of OUT's partial folder
    save_unconverged: bool = False
    progress: bool = True
    device: str = "auto"

    def __post_init__(self) -> None:
        path("source", self.source)
        path("out", self.out)
        instance("text", self.text, TextOptions)
        instance("config", self.config, FinetuneConfig)
        for name in ("overwrite", "restart", "save_unconverged", "progress"):
            switch(name, getattr(self, name))
        path("--resume-from", self.resume_from, optional=True)
        device(self.device)
        self.config.check()
        MarginOptions(headroom_bits=self.config.headroom_bits)  # the exact rescale's margin, checked with the rest
        if self.restart and self.resume_from:
            raise HalfsafeError("--restart discards a saved state and --resume-from continues one: pass one of them")

    @property
    def plan(self) -> PlanOptions:
        """The exact rescale that runs first: the config's margin, and saved whatever no rescale reaches."""
        return PlanOptions(MarginOptions(headroom_bits=self.config.headroom_bits), allow_unfixable=True)
