"""The residual stream's largest |value| after each block: where a variant comes near (or past) fp16's limit."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.sites import Hooks


class BlockPeaks:
    """Forward hooks: |x| max of each block's output (the residual stream after that block), inf once any is
    non-finite, over every forward pass until `remove()`."""

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        modules = dict(model.named_modules())
        self.peaks = [0.0] * len(blocks)
        self.handles = Hooks()
        for i, b in enumerate(blocks):
            if b in modules:
                self.handles.add_post(modules[b], self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out):
            x = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                v = float(x.detach().abs().max())
                self.peaks[i] = math.inf if not math.isfinite(v) else max(self.peaks[i], v)

        return hook

    def remove(self) -> None:
        self.handles.remove()
