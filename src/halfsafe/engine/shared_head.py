"""A streamed model's wide LM head, read once for all the samples of a scan's pass instead of once per call.

The scan measures the head's output at every position. A head too big to hold (engine.wide: Gemma's 262144 x 640,
Qwen's 152064 x 3584) is read a slice of rows at a time on every call, and the calls are chunks of positions small
enough to keep their float32 logits within `core.forward.HEAD_CHUNK_BYTES`: a 512-token sample called it 8 times
(Gemma 3) or 5 (Qwen 7B), so a pass of 8 samples read the head 64 or 40 times. Here each sample's body hands its last
hidden state over (`take`), and after the pass `run` reads each slice of rows once and multiplies it by every
sample's positions; each [positions, rows] product is recorded at the head's sites as that sample's own (its lane),
as the hooks would record the head's output, a slice of logits at a time. No [positions, vocab] logits ever exist:
memory holds the samples' hidden states (8 x 512 x 3584 in float32: 59 MB; `HIDDEN_BYTES` at most) and one slice's
product. The products are those the head's own calls compute, a row of logits from the same slice of rows: every
peak and count is the same; the sampled statistics of the output (its percentile, the share of it below float16's
normal range) come from samples of other chunks, [positions, rows] instead of [chunk of positions, vocab].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.forward import head_chunk
from ..core.lanes import lane, set_lane
from ..core.sites import Site
from ..progress import worked
from .shards import row_spans
from .streamed import Streamed, streamed_of

HIDDEN_BYTES = 256 << 20  # the samples' hidden states kept for the head at most; beyond, each sample calls its head


@dataclass
class SharedHead:
    streamed: Streamed
    head: nn.Linear
    module: str  # the head's module name (its sites)
    param: str  # the canonical name of its weight (a tied head's is the embedding's)
    record: Callable[[str, nn.Module, torch.Tensor], None] | None  # a collector's `record`; None: computed only
    pending: list = field(default_factory=list)  # (lane, hidden state) of each sample, in the order they came

    @classmethod
    def of(cls, model, samples, record: Callable | None = None) -> "SharedHead | None":
        """The shared head of `model` for `samples`, or None where each sample calls its own: an in-memory model, a
        head that is not a plain bias-free nn.Linear (a subclass may compute otherwise), one small enough to hold, or
        samples whose hidden states together pass HIDDEN_BYTES."""
        s, head = streamed_of(model), model.get_output_embeddings()
        if s is None or type(head) is not nn.Linear or head.bias is not None:
            return None
        param = next((name for slots in s.units.values() for slot, name in slots
                      if slot.module is head and slot.attr == "weight"), None)
        if param is None or not s._is_wide(param):
            return None
        positions = sum(t.shape[-1] for t in samples if isinstance(t, torch.Tensor))
        if len(samples) < 2 or positions * head.in_features * 4 > HIDDEN_BYTES:
            return None
        module = next(n for n, m in model.named_modules() if m is head)
        return cls(s, head, module, param, record)

    def take(self, hidden: torch.Tensor) -> None:
        """The last hidden state [batch, positions, in_features] of the sample computing now (its lane)."""
        self.pending.append((lane(), hidden))

    @torch.no_grad()
    def run(self) -> None:
        """The head on every sample taken, each slice of its rows read once (module docstring)."""
        if not self.pending:
            return
        weight = self.streamed.wide(self.param)
        n = weight.shape[0]
        site_in, site_out = str(Site(self.module, "in")), str(Site(self.module, "out"))
        try:
            if self.record is not None:  # the head's input, as its pre-hook recorded it: the chunks it was called on
                for i, hidden in self.pending:
                    set_lane(i)
                    for chunk in hidden.split(head_chunk(n), dim=1):
                        self.record(site_in, self.head, chunk)
            for start, stop in row_spans(n, weight.chunk_rows()):
                rows = weight.rows(start, stop)
                for i, hidden in self.pending:
                    lead = hidden.shape[:-1]
                    part = F.linear(hidden.reshape(math.prod(lead), -1), rows)  # 2-d, as engine.wide's `_linear`
                    if self.record is not None:
                        set_lane(i)
                        self.record(site_out, self.head, part.view(*lead, stop - start))
                    del part
                    worked(self.head, (stop - start) / n)  # this sample's share of the head, for the phase's ETA
                del rows
        finally:
            set_lane(None)
            self.pending.clear()
