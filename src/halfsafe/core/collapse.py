"""Outputs that are finite and still broken: most rows nearly uniform, or one token on top nearly everywhere while
the reference disagrees. Kept as sums over rows, so that texts of different lengths merge; verify's accumulator
reports them (verify --runtime) and convert --runtime refuses a plan whose outputs collapse."""

from __future__ import annotations

import math
from collections import Counter

import torch

UNIFORM = 0.9  # a row whose entropy is above 90% of log(vocab) carries almost no information
COLLAPSED_MODE = 0.9  # above this share of positions with the same top-1, one token is on top nearly everywhere
ROWS = 16  # positions compared at a time (a 262k vocabulary: 16 MiB per float32 temporary)


class CollapseSums:
    """Entropy, near-uniform rows and top-1 counts of a variant's finite rows against the reference's."""

    def __init__(self) -> None:
        self.entropy_sum = 0.0
        self.uniform = 0
        self.top_counts: Counter = Counter()

    def add(self, o: torch.Tensor, r: torch.Tensor, vocab: int) -> None:
        """Finite rows `o` of the variant against the same rows `r` of the reference."""
        entropy, ref_entropy = _entropy(o), _entropy(r)
        self.entropy_sum += float(entropy.sum())
        near = UNIFORM * math.log(vocab)
        self.uniform += int(((entropy > near) & (ref_entropy <= near)).sum())  # rows that *became* near-uniform
        self.top_counts.update(o.argmax(-1).tolist())

    def merge(self, other: CollapseSums) -> None:
        self.entropy_sum += other.entropy_sum
        self.uniform += other.uniform
        self.top_counts.update(other.top_counts)

    def fields(self) -> dict:
        """Metrics' collapse fields: entropy_mean, uniform_positions, mode_fraction."""
        counted = sum(self.top_counts.values())
        mode = self.top_counts.most_common(1)[0][1] / counted if counted else 0.0
        return {"entropy_mean": self.entropy_sum / counted if counted else math.nan, "uniform_positions": self.uniform,
                "mode_fraction": mode}


def is_collapsed(positions: int, uniform_positions: int, mode_fraction: float, top1: float) -> bool:
    """Most rows nearly uniform, or one token on top nearly everywhere while the reference disagrees."""
    return uniform_positions > max(positions, 1) / 2 or (mode_fraction > COLLAPSED_MODE and top1 < 0.5)


@torch.no_grad()
def collapsed(ref: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether logits `out` collapse against `ref` (same shape), counted ROWS positions at a time as verify's
    accumulator counts them."""
    vocab = out.shape[-1]
    flat, ref_flat = out.reshape(-1, vocab), ref.reshape(-1, vocab)
    sums, hits = CollapseSums(), 0
    for lo in range(0, flat.shape[0], ROWS):
        o, r = flat[lo:lo + ROWS], ref_flat[lo:lo + ROWS]
        hits += int((r.argmax(-1) == o.argmax(-1)).sum())
        keep = torch.isfinite(o).all(-1)
        sums.add(o[keep].float(), r[keep].float(), vocab)
    n = flat.shape[0]
    fields = sums.fields()
    return is_collapsed(n, fields["uniform_positions"], fields["mode_fraction"], hits / max(n, 1))


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).nan_to_num().sum(-1)
