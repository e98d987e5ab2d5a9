"""Sums over tokens, per text and overall, that become a variant's Metrics: KL to the reference, top-1
agreement, perplexity, non-finite counts, max logit error and greedy agreement.

Sums (not means) so that texts of different lengths merge into an overall figure weighted by tokens.
"""

from __future__ import annotations

import math

import torch

from ..core.collapse import ROWS, CollapseSums  # ROWS: positions at a time, as convert --runtime counts collapse
from ..core.metrics import kl_per_token
from .report import Metrics


@torch.no_grad()
def nll_sum(logits: torch.Tensor, ids: torch.Tensor, encoder_decoder: bool, chunk: int = 16) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods (float64) and how many tokens it covers."""
    logits, ids = logits[0], ids[0].to(logits.device)
    if not encoder_decoder:  # position i predicts token i+1; teacher-forced decoders predict token i at i
        logits, ids = logits[:-1], ids[1:]
    total = 0.0
    for lo, tgt in zip(logits.split(chunk), ids.split(chunk)):
        lo = lo.double()
        total += float((torch.logsumexp(lo, -1) - lo.gather(-1, tgt[:, None])[:, 0]).sum())
    return total, int(ids.numel())


class Accumulator:
    """One variant's sums against the reference; `lm`: also the perplexity (the logits predict tokens)."""

    def __init__(self, lm: bool, collapse: bool = False) -> None:
        self.lm = lm
        self.collapse = collapse  # also the entropy, near-uniform rows and top-1 counts (Metrics.collapsed)
        self.collapse_sums = CollapseSums()
        self.positions = self.nonfinite_logits = self.nonfinite_positions = self.top1_hits = self.nll_tokens = 0
        self.kl_sum = self.nll_sum = self.max_err = 0.0
        self.greedy_matched = self.greedy_total = 0
        self.has_greedy = False

    def add(self, ref, out: torch.Tensor, ids: torch.Tensor, encoder_decoder: bool) -> None:
        """One sample's logits `out` against the reference's `ref` (a tensor, or anything whose `rows(lo, hi)`
        gives rows of its [positions, vocab] view, such as the reference read back from disk), a few positions
        at a time: no temporary of the whole [positions, vocab] size is made (262k vocabulary: 1 MiB a row)."""
        vocab = out.shape[-1]
        flat = out.reshape(-1, vocab)
        rows = ref.rows if hasattr(ref, "rows") else (lambda lo, hi, r=ref.reshape(-1, vocab): r[lo:hi])
        for lo in range(0, flat.shape[0], ROWS):
            o, r = flat[lo:lo + ROWS], rows(lo, lo + ROWS)
            finite = torch.isfinite(o)
            self.nonfinite_logits += int(finite.numel() - finite.sum())
            self.nonfinite_positions += int((~finite.all(-1)).sum())
            self.kl_sum += float(kl_per_token(r, o).sum())
            self.top1_hits += int((r.argmax(-1) == o.argmax(-1)).sum())
            self.max_err = _nanmax(self.max_err, float((o.float() - r.float()).abs().max()))
            if self.collapse:
                keep = finite.all(-1)
                self.collapse_sums.add(o[keep].float(), r[keep].float(), vocab)
        self.positions += flat.shape[0]
        if self.lm:
            nll, n = nll_sum(out, ids, encoder_decoder)
            self.nll_sum += nll
            self.nll_tokens += n

    def add_greedy(self, matched: int, total: int) -> None:
        self.has_greedy = True
        self.greedy_matched += matched
        self.greedy_total += total

    def merge(self, other: Accumulator) -> None:
        for k in ("positions", "nonfinite_logits", "nonfinite_positions", "top1_hits", "nll_tokens", "kl_sum", "nll_sum",
                  "greedy_matched", "greedy_total"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.max_err = _nanmax(self.max_err, other.max_err)
        self.has_greedy = self.has_greedy or other.has_greedy
        self.collapse_sums.merge(other.collapse_sums)

    def metrics(self) -> Metrics:
        n = max(self.positions, 1)
        return Metrics(
            positions=self.positions,
            nonfinite_logits=self.nonfinite_logits,
            nonfinite_positions=self.nonfinite_positions,
            kl_mean=self.kl_sum / n,
            top1=self.top1_hits / n,
            perplexity=_exp(self.nll_sum / self.nll_tokens) if self.lm and self.nll_tokens else None,
            max_abs_logit_error=self.max_err,
            greedy_matched=self.greedy_matched if self.has_greedy else None,
            greedy_total=self.greedy_total if self.has_greedy else None,
            **(self.collapse_sums.fields() if self.collapse else {}),
        )

def _nanmax(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def matched_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `b` shares with `a` from the start: greedy agreement up to the first divergence."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


