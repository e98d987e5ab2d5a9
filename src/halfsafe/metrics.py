"""Output fidelity between a reference run (fp32) and another run of the same text."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_per_token(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position, in nats, computed in float64. inf/NaN logits give NaN."""
    ref = F.log_softmax(ref_logits.double(), dim=-1)
    other = F.log_softmax(logits.double(), dim=-1)
    return (ref.exp() * (ref - other)).sum(-1).flatten()


def mean_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    if not torch.isfinite(logits).all():
        return float("nan")
    return float(kl_per_token(ref_logits, logits).mean())


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    return float((ref_logits.argmax(-1) == logits.argmax(-1)).double().mean())
