"""A plain mixed-precision training loop (autocast + GradScaler), the way fp16 fine-tuning runs on a
T4/V100: used by the tests and bench/training/finetune_curves.py to compare precisions on the same steps."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .coordinates import TrainingRescaler

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainRun:
    precision: str
    losses: list[float] = field(default_factory=list)  # the forward loss of each step (NaN/inf kept)
    skipped: list[bool] = field(default_factory=list)  # GradScaler skipped the update (inf/NaN gradients)
    loss_scale: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in self.losses)

    @property
    def nonfinite_steps(self) -> int:
        return sum(not math.isfinite(x) for x in self.losses)

    def to_dict(self) -> dict:
        return {"precision": self.precision, "losses": self.losses, "skipped": self.skipped,
                "loss_scale": self.loss_scale, "seconds": self.seconds}


def device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def train_steps(
    model: nn.Module,
    batches: list[torch.Tensor],
    precision: str = "fp16",
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    optimizer: torch.optim.Optimizer | None = None,
    keep_coordinates=None,
    on_step=None,
    init_scale: float = 2.0 ** 16,
) -> TrainRun:
    """One optimizer step per batch (causal LM loss on the batch itself) under `precision` autocast.

    fp16 uses a GradScaler, as AMP does: a step whose gradients overflow is skipped and the scale
    halves (from `init_scale`, torch's default 2**16). `keep_coordinates`: the plan a converted model carries (a `Plan` or group exponents); the
    optimizer then works in the unconverted model's coordinates (see coordinates.py), so the run can
    be compared step for step with the original model's.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    dev = device_type(model)
    opt = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    rescaler = TrainingRescaler.for_converted(model, opt, keep_coordinates) if keep_coordinates else None
    scaler = torch.amp.GradScaler(dev, init_scale=init_scale, enabled=precision == "fp16")
    run = TrainRun(precision)
    was_training = model.training
    model.train()
    try:
        for step, ids in enumerate(batches):
            t0 = time.perf_counter()
            ids = ids.to(next(model.parameters()).device)
            with torch.autocast(dev, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            scaler.scale(loss).backward()
            if max_grad_norm:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            skipped = scaler.is_enabled() and scaler.get_scale() < scale_before
            run.losses.append(float(loss.detach()))
            run.skipped.append(bool(skipped))
            run.loss_scale.append(float(scale_before))
            run.seconds.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step(step, run)
    finally:
        model.train(was_training)
        if rescaler is not None:
            rescaler.remove()
    return run
