"""Sites, the blocks that own them, headroom, and the one owner of forward hooks.

A *site* is one tensor the model computes, named "module:kind":
    "name:out"               a module's output
    "name:in"                a (leaf) module's first input
    "name:expert<e>"         expert e's gated product inside a fused-experts module (what its down projection reads)
    "name:expert<e>.gate"    ... its gate pre-activation
    "name:expert<e>.up"      ... its up pre-activation
    "name:out@2"             the same tensor at the module's 2nd call inside one run of the module around it
Module names contain dots, never ":"; the kind is what follows the last ":". Reports, plans and the dicts
that carry measurements key sites by these strings; `Site` parses and formats them, so they stay the same.

A module called more than once inside one forward of the module that calls it (T5's `T5Stack.dropout`, applied
to the embeddings, which move with the residual stream, and after the final norm, which does not) computes a
different tensor at each call, and a rescale may move one call and not the other: each call is its own site,
the first keeping the plain name, so no site's owner has to be guessed from a maximum over calls.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..errors import HalfsafeError
from .formats import FP16_MAX

_KIND = re.compile(r"(in|out|expert(\d+)(\.gate|\.up)?)")
_CALL = re.compile(r"(.*)@([2-9]|[1-9]\d+)")  # "@<n>" after the kind: the n-th call (n >= 2)


@dataclass(frozen=True)
class Site:
    module: str
    kind: str = "out"  # "in", "out", "expert<e>", "expert<e>.gate", "expert<e>.up"
    call: int = 1  # which call of the module inside one run of its caller (1: the first, named without "@")

    def __post_init__(self) -> None:
        if ":" in self.module or not _KIND.fullmatch(self.kind) or not (isinstance(self.call, int) and self.call >= 1):
            raise HalfsafeError(f"not a site: {self.module!r}, {self.kind!r}: write it as 'module:out', 'module:in' "
                                "or 'module:expert<e>[.gate|.up]'")

    @classmethod
    def parse(cls, text: "str | Site") -> "Site":
        if isinstance(text, Site):
            return text
        module, sep, kind = text.rpartition(":")
        if not sep:
            raise HalfsafeError(f"not a site: {text!r}: write it as 'module:out', 'module:in' or 'module:expert<e>[.gate|.up]'")
        call = _CALL.fullmatch(kind)
        return cls(module, call.group(1), int(call.group(2))) if call else cls(module, kind)

    @classmethod
    def of_expert(cls, module: str, expert: int, part: str = "") -> "Site":
        """Expert `expert`'s gated product ("" part), or its "gate" / "up" pre-activation."""
        return cls(module, f"expert{expert}" + (f".{part}" if part else ""))

    def __str__(self) -> str:
        return f"{self.module}:{self.kind}" + (f"@{self.call}" if self.call > 1 else "")

    def at_call(self, call: int) -> "Site":
        return Site(self.module, self.kind, call)

    @property
    def expert(self) -> int | None:
        """The expert an expert site names, else None."""
        m = _KIND.fullmatch(self.kind)
        assert m is not None  # __post_init__ refused any other kind
        return int(m.group(2)) if m.group(2) is not None else None

    @property
    def part(self) -> str:
        """"gate" or "up" for an expert's pre-activations, "" otherwise."""
        m = _KIND.fullmatch(self.kind)
        assert m is not None  # __post_init__ refused any other kind
        return (m.group(3) or "")[1:]


def module_of(module_or_site: "str | Site") -> str:
    """The module name of a Site, a site string ("a.b:out") or a module name ("a.b")."""
    if isinstance(module_or_site, Site):
        return module_or_site.module
    return Site.parse(module_or_site).module if ":" in module_or_site else module_or_site


def within(module: str, prefix: str) -> bool:
    """`module` is `prefix` or sits inside it ("layers.10" is not inside "layers.1")."""
    return module == prefix or module.startswith(prefix + ".")


def block_of(module_or_site: "str | Site", blocks) -> str | None:
    """The block that owns a module (or a site's module): the longest block name it is, or sits inside; None
    outside every block (embeddings, final norm, head)."""
    module = module_of(module_or_site)
    found = None
    for b in blocks:
        if within(module, b) and (found is None or len(b) > len(found)):
            found = b
    return found


def headroom_bits(peak: float) -> float:
    """log2(65504 / peak): doublings left before float16 overflows (negative: over it; -inf: inf or NaN seen;
    inf: nothing but zeros)."""
    if not math.isfinite(peak):
        return -math.inf
    return math.log2(FP16_MAX / peak) if peak > 0 else math.inf


class Hooks:
    """Owns forward hooks (and other undo steps): `remove()`, or leaving the `with` block, takes every one off,
    newest first, also after an exception; removing twice is harmless."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def add_pre(self, module: nn.Module, fn, *, with_kwargs: bool = False):
        return self.add_handle(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def add_post(self, module: nn.Module, fn, *, with_kwargs: bool = False, always_call: bool = False):
        return self.add_handle(module.register_forward_hook(fn, with_kwargs=with_kwargs, always_call=always_call))

    def add_handle(self, handle):
        """Any handle with a `remove()` (a tensor hook, a hook registered elsewhere)."""
        self._undo.append(handle.remove)
        return handle

    def add_undo(self, undo: Callable[[], None]) -> None:
        """A step that `remove()` runs (undoing a patch that is not a hook)."""
        self._undo.append(undo)

    def remove(self) -> None:
        error = None
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as e:  # keep removing the rest; report the first failure
                error = error or e
        if error is not None:
            raise error

    def __len__(self) -> int:
        return len(self._undo)

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

def find_blocks(model: nn.Module) -> list[str]:
    """Names of the repeated blocks: the elements of each outermost ModuleList whose items share a
    class (excludes T5's mixed per-block `layer` list; MoE expert lists sit inside blocks)."""
    blocks: list[str] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(t + ".") for t in taken):
            continue
        if len({type(m) for m in module}) != 1:
            continue
        taken.append(name)
        blocks.extend(f"{name}.{i}" for i in range(len(module)))
    return blocks
