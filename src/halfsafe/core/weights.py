"""The one seam between the pure part and whoever holds a model's weights.

Core reads and changes a model's tensors only through `weights_of(model)`, a `Weights`: the parameters themselves
for an ordinary model (`InMemory`), or whatever a model that keeps its weights elsewhere attached to it with
`hold` (halfsafe.engine's streamed model, which loads each block from the checkpoint's shards as it runs). So
core never asks how a model holds its weights, and never imports the engine that streams them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import nn

from ..families import GAIN1P, MUL
from .formats import all_finite
from .groups import select_parts

WEIGHTS_ATTR = "_halfsafe_weights"  # where `hold` puts a model's Weights


class Weights(Protocol):
    """What core needs of a model's weights."""

    @property
    def device(self) -> torch.device:
        """Where the model computes."""
        ...

    def values(self) -> Mapping[str, torch.Tensor]:
        """name -> each parameter's current value (stored value, current rescale). A mapping may also offer
        `blocks(name)`, the same value a block of rows at a time (see `value_blocks`)."""
        ...

    def rescale_(self, table: dict[str, list]) -> None:
        """Rescale by a `rewrite.tensor_exponents` table, on top of every rescale so far."""
        ...

    def snapshot(self, names: Iterable[str]) -> Callable[[], None]:
        """What puts the named parameters back as they are now, after a rescale and its inverse (which undo `mul`
        moves bit for bit, not `(1+w)` gains rounded twice)."""
        ...

    def held(self) -> AbstractContextManager:
        """Within: the weights outside the blocks (embeddings, head) stay at hand across several calls (a head run
        on chunks of positions after the body)."""
        ...


class InMemory:
    """The weights of an ordinary model: its parameters, changed in place."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def values(self) -> Mapping[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def rescale_(self, table: dict[str, list]) -> None:
        params = dict(self.model.named_parameters())
        for name, entries in table.items():
            rescaled(params[name].data, entries)
        check_finite(self.model, table)

    def snapshot(self, names: Iterable[str]) -> Callable[[], None]:
        params = dict(self.model.named_parameters())
        saved = {name: params[name].detach().clone() for name in names}

        @torch.no_grad()
        def restore() -> None:
            for name, t in saved.items():
                params[name].data.copy_(t)

        return restore

    def held(self) -> AbstractContextManager:
        return nullcontext()


def weights_of(model: nn.Module) -> Weights:
    """The weights `model` computes with: those attached by `hold`, else its own parameters."""
    held = getattr(model, WEIGHTS_ATTR, None)
    return held if held is not None else InMemory(model)


def hold(model: nn.Module, weights: Weights) -> None:
    """From now on `model` computes with `weights` (a model whose parameters are placeholders until loaded)."""
    setattr(model, WEIGHTS_ATTR, weights)


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes (a streamed model's parameters rest on meta: its weights say where)."""
    return weights_of(model).device


def value_blocks(values: Mapping[str, torch.Tensor], name: str) -> Iterator[torch.Tensor]:
    """Parameter `name` of `values` in blocks of whole rows where the mapping reads it so (a 262k-token embedding
    is 0.7 GB in float32), else the tensor itself."""
    blocks = getattr(values, "blocks", None)
    if blocks is not None:
        yield from blocks(name)
    else:
        yield values[name]


def part_index(t: torch.Tensor, select) -> tuple:
    """An index for t[...] that takes the selected part: slices in every dim, at most one index list
    (a fused expert tensor's part is its expert's slice times one slice or list of rows)."""
    idx: list = [slice(None)] * t.dim()
    for dim, index in select_parts(select):
        idx[dim] = index
    return tuple(idx)


@torch.no_grad()
def scale_tensor_(t: torch.Tensor, kind: str, exponent: int, select=None) -> None:
    s = 2.0 ** exponent
    if kind == MUL:
        if select is None:
            t.mul_(s)
        else:
            idx = part_index(t, select)
            t[idx] = t[idx] * s
    elif kind == GAIN1P:
        t.copy_(((1.0 + t.double()) * s - 1.0).to(t.dtype))
    else:
        raise ValueError(f"unknown move kind {kind!r}")


@torch.no_grad()
def rescaled(t: torch.Tensor, entries) -> torch.Tensor:
    """`t` (owned by the caller) with every (kind, exponent, select) of `tensor_exponents` applied, in place."""
    for kind, e, select in entries:
        scale_tensor_(t, kind, e, select)
    return t


@torch.no_grad()
def unrescaled(t: torch.Tensor, entries, saved: torch.Tensor | None = None) -> torch.Tensor:
    """`t` as it was before `rescaled(t, entries)`, in place: `mul` parts by the inverse power of two (exact); a
    `(1+w)` gain, which does not invert exactly, from `saved`, its value from before."""
    for kind, e, select in entries:
        if kind == MUL:
            scale_tensor_(t, MUL, -e, select)
        elif saved is None:
            raise ValueError("a (1+w) gain cannot be unscaled exactly: pass the value it had before (saved)")
    if saved is not None:
        t.copy_(saved)
    return t


def check_finite(model: nn.Module, names) -> None:
    """After a rewrite: every rescaled weight still finite (a plan never overflows a weight; if it did, say so)."""
    params = dict(model.named_parameters())
    bad = [n for n in names if n in params and params[n].device.type != "meta" and not all_finite(params[n])]
    if bad:
        raise FloatingPointError(f"rescaling made {', '.join(bad[:3])} non-finite (please report this)")
