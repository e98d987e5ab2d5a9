"""Output fidelity between a reference run (fp32) and another run of the same text."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import all_finite


def kl_per_token(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """KL(ref || other) per position, in nats, computed in float64 a few positions at a time (a 262k
    vocabulary makes each position 2 MB in float64). inf/NaN logits give NaN."""
    vocab = ref_logits.shape[-1]
    out = []
    for r, o in zip(ref_logits.reshape(-1, vocab).split(chunk), logits.reshape(-1, vocab).split(chunk)):
        r = F.log_softmax(r.double(), dim=-1)
        o = F.log_softmax(o.double(), dim=-1)
        out.append((r.exp() * (r - o)).sum(-1))
    return torch.cat(out)


def mean_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    if not all_finite(logits):
        return float("nan")
    return float(kl_per_token(ref_logits, logits).mean())


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    return float((ref_logits.argmax(-1) == logits.argmax(-1)).double().mean())
