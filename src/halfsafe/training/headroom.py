"""Cheap peak sampling during training: |x| max at chosen sites on one forward pass, then the hooks go.

Sites are named as `stats.ActivationCollector` names them ("module:out", "leaf:in"), so sampled peaks
plug straight into the planner (`plan.solve_peaks`). The hooks are a `stats.SiteCollector`'s; each keeps one
scalar tensor (no host sync inside the forward); `collect()` turns them into floats.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager

import torch
from torch import nn

from ..core.sites import Site, block_of, find_blocks, headroom_bits
from ..core.stats import SiteCollector

WATCH_ALL = "all"  # block outputs plus every leaf module's input and output
WATCH_BLOCKS = "blocks"  # block outputs only (the residual stream)

__all__ = ["WATCH_ALL", "WATCH_BLOCKS", "GradSampler", "PeakSampler", "headroom_bits", "plain_fp32_forward"]


class PeakSampler(SiteCollector):
    """`arm()` before a forward pass; the hooks record that one pass and remove themselves.

    watch: "all", "blocks", or a list of regular expressions over site names (block outputs are
    always included).
    """

    def __init__(self, model: nn.Module, watch: str | list[str] = WATCH_ALL):
        super().__init__(model)
        self.blocks = find_blocks(model)
        self.sites = self._choose(watch)
        self.peaks: dict[str, torch.Tensor] = {}
        self.input_ids: torch.Tensor | None = None  # a short slice of the sampled batch (for probing)
        self._index = {b: i for i, b in enumerate(self.blocks)}

    def _choose(self, watch) -> list[Site]:
        blocks = set(self.blocks)
        sites: list[Site] = []
        patterns = None if isinstance(watch, str) else [re.compile(p) for p in watch]
        if isinstance(watch, str) and watch not in (WATCH_ALL, WATCH_BLOCKS):
            raise ValueError(f"watch must be {WATCH_ALL!r}, {WATCH_BLOCKS!r} or a list of regular expressions, not {watch!r}")
        for name, module in self.model.named_modules():
            if not name:
                continue
            leaf = next(module.children(), None) is None
            for kind in (("in", "out") if leaf else ("out",)):
                site = Site(name, kind)
                if name in blocks and kind == "out":
                    sites.append(site)
                elif watch == WATCH_ALL and leaf:
                    sites.append(site)
                elif patterns is not None and any(p.search(str(site)) for p in patterns):
                    sites.append(site)
        return sites

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        if self.armed:
            return
        self.peaks = {}
        self.watch_all(self.sites)
        self._handles.add_pre(self.model, self._capture_ids, with_kwargs=True)
        self._handles.add_post(self.model, lambda *_: self.disarm(), always_call=True)

    def disarm(self) -> None:
        self.remove()

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        peak = t.detach().abs().amax().float()  # a tensor: no host sync inside the forward
        old = self.peaks.get(site)
        self.peaks[site] = peak if old is None else torch.maximum(old, peak)

    def _capture_ids(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            self.input_ids = ids[:1, :32].detach().clone()

    def collect(self) -> dict[str, float]:
        """Peaks of the last armed pass (NaN counts as overflow: inf); clears them."""
        out = {}
        for site, t in self.peaks.items():
            v = float(t)
            out[site] = math.inf if math.isnan(v) else v
        self.peaks = {}
        return out

    def layer_of(self, site: str) -> int | None:
        """The index of the block that owns `site`, None outside the blocks."""
        return self._index.get(block_of(site, self.blocks))


class GradSampler(PeakSampler):
    """The largest |gradient| reaching each output site PeakSampler watches with "all" (block outputs and every leaf's
    output), over every backward of the grad-enabled forwards between `arm()` and `collect()` (a step's, however
    many forwards it runs); `collect()` names them "module:grad"."""

    def __init__(self, model: nn.Module):
        super().__init__(model, WATCH_ALL)
        self.sites = [s for s in self.sites if s.kind == "out"]

    def arm(self) -> None:  # no capture of ids, no disarm after one forward: the step's forwards all count
        if self.armed:
            return
        self.peaks = {}
        self.watch_all(self.sites)

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        if t.requires_grad and t.is_floating_point():
            t.register_hook(lambda g: super(GradSampler, self).record(site, module, g))

    def collect(self) -> dict[str, float]:
        self.disarm()
        return {f"{Site.parse(site).module}:grad": v for site, v in super().collect().items()}


@contextmanager
def plain_fp32_forward(model: nn.Module):
    """Run `model` in eval mode without autocast, even where accelerate patched its forward with one."""
    patched = model.__dict__.get("forward")
    original = getattr(model, "_original_forward", None)
    was_training = model.training
    if patched is not None and original is not None:
        model.forward = original
    model.eval()
    try:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else _null():
            yield model
    finally:
        model.train(was_training)
        if patched is not None and original is not None:
            model.forward = patched


@contextmanager
def _null():
    yield
