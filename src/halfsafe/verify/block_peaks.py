"""The residual stream's largest |value| after each block: where a variant comes near (or past) fp16's limit."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.sites import Hooks, Site
from ..core.stats import SiteCollector


class BlockPeaks(SiteCollector):
    """Forward hooks: |x| max of each block's output (the residual stream after that block), inf once any is
    non-finite, over every forward pass until `remove()`. Blocks the model lacks are skipped (their peak stays 0)."""

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        super().__init__(model)
        modules = dict(model.named_modules())
        self.peaks = [0.0] * len(blocks)
        self._slots: dict[str, list[int]] = {}  # site -> its places in `peaks`
        for i, b in enumerate(blocks):
            if b in modules:
                site = str(Site(b, "out"))
                if site not in self._slots:
                    self.watch(site)
                self._slots.setdefault(site, []).append(i)

    @property
    def handles(self) -> Hooks:
        return self._handles

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        if not t.numel():
            return
        v = float(t.detach().abs().max())
        for i in self._slots[site]:
            self.peaks[i] = math.inf if not math.isfinite(v) else max(self.peaks[i], v)
