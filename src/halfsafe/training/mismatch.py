"""How far the rollout engine's policy is from the trainer's, on the tokens the engine sampled.

RL samples completions with one engine (vLLM) and trains on them with another (transformers); both compute the same
policy with different kernels. For each sampled token, `rollout` is the engine's log-probability of it and `trainer`
the trainer's, in the same dtype, on the same weights. Their ratio r = exp(trainer - rollout) is the importance weight
an off-policy correction would need; where it strays far from 1, RL's on-policy assumption is broken (arXiv
2510.26788 measures this in bf16 against fp16).

    mean_abs   mean |trainer - rollout| over the sampled tokens
    k3         mean of (r - 1) - log r: an unbiased, never negative estimate of KL(rollout || trainer) from
               samples of the rollout policy (Schulman's k3)
    max_abs    the largest |trainer - rollout|
    outside    the share of tokens whose r lies outside [0.8, 1.25] (a PPO-style clip range)
"""

from __future__ import annotations

import math

import torch

OUTSIDE = (0.8, 1.25)
KEYS = ("mean_abs", "k3", "max_abs", "outside")


def rollout_mismatch(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """The four figures above over the tokens where `mask` is true (all, when None); tokens where either
    log-probability is NaN (the engine could not score them) are left out and counted in `unscored`."""
    trainer, rollout = trainer.detach().double(), rollout.detach().double()
    keep = torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.bool()
    scored = keep & ~torch.isnan(trainer) & ~torch.isnan(rollout)
    diff = (trainer - rollout)[scored]
    out = {"tokens": int(scored.sum()), "unscored": int((keep & ~scored).sum())}
    if diff.numel() == 0:
        return {**out, **{k: math.nan for k in KEYS}}
    ratio = torch.exp(diff)
    k3 = (ratio - 1) - diff  # log r = diff; inf where the trainer finds the token far likelier: kept, not hidden
    low, high = OUTSIDE
    return {**out, "mean_abs": float(diff.abs().mean()), "k3": float(k3.mean()), "max_abs": float(diff.abs().max()),
            "outside": float(((ratio < low) | (ratio > high)).double().mean())}
