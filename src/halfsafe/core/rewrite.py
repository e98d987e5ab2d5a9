"""The one rewrite: scale each group's tensors by 2**(exponent * power), and move the norm eps with them.

Power-of-two multiplications are exact in any binary float format (barring overflow or subnormals), so
applying exponents and then their negation restores `mul` tensors bit for bit. `(1+w)` gains are
computed in float64 and rounded once to the parameter's dtype; `trial` puts their stored values back.

Group exponents become one table per tensor here (`tensor_exponents`); the model's `Weights` (`core.weights`)
apply it: an in-memory model's parameters change in place, a model that keeps its weights in the checkpoint
(halfsafe.engine's streamed model) changes the table its loads apply, so the same calls work on a model of any size.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..families import GAIN1P, Family
from .groups import EpsHolders, Group, config_at, select_parts
from .sites import within
from .weights import weights_of


def tensor_exponents(groups: list[Group], exponents: dict[str, int]) -> dict[str, list[tuple[str, int, object]]]:
    """param -> [(kind, total exponent, select)], merging every group that moves the same tensor part."""
    merged: dict[str, dict] = defaultdict(dict)
    for g in groups:
        e = exponents.get(g.name, 0)
        if not e:
            continue
        for m in g.moves:
            key = (m.kind, select_key(m.select))
            kind, total, select = merged[m.param].get(key, (m.kind, 0, m.select))
            merged[m.param][key] = (kind, total + e * m.power, select)
    return {p: [v for v in entries.values() if v[1]] for p, entries in merged.items() if any(v[1] for v in entries.values())}


def model_key(groups: list[Group], exponents: dict[str, int]) -> tuple:
    """What `exponents` do to a model, hashable: exponents with equal keys make the same model bit for bit (the same
    rescales of the same tensors, in the same order, and the same eps moves)."""
    table = tuple((p, tuple((kind, e, select_key(select)) for kind, e, select in entries))
                  for p, entries in tensor_exponents(groups, exponents).items())
    return table, eps_exponent(groups, exponents), tuple(sorted(scoped_eps_exponents(groups, exponents).items(), key=repr))


def select_key(select) -> object:
    """A move's select in a hashable, comparable form (index tensors as tuples)."""
    if select is None:
        return None
    parts = tuple((dim, (index.start, index.stop, index.step) if isinstance(index, slice) else tuple(index.tolist()))
                  for dim, index in select_parts(select))
    return parts[0] if len(parts) == 1 else parts


def merge_tables(a: dict, b: dict) -> dict:
    """Two tensor_exponents tables applied one after the other, as one (entries that cancel are dropped)."""
    out: dict[str, dict] = defaultdict(dict)
    for table in (a, b):
        for name, entries in table.items():
            for kind, e, select in entries:
                key = (kind, select_key(select))
                k, total, sel = out[name].get(key, (kind, 0, select))
                out[name][key] = (k, total + e, sel)
    return {n: [v for v in d.values() if v[1]] for n, d in out.items() if any(v[1] for v in d.values())}


def eps_exponent(groups: list[Group], exponents: dict[str, int]) -> int:
    """The family's norm eps moves by 2**(this)."""
    return sum(g.eps_power * exponents.get(g.name, 0) for g in groups if not g.eps_field)


def scoped_eps_exponents(groups: list[Group], exponents: dict[str, int]) -> dict[str, int]:
    """Config field -> exponent, for the groups that move an eps of their own (a tower's, Group.eps_field)."""
    out: dict[str, int] = {}
    for g in groups:
        if g.eps_field and g.eps_power * exponents.get(g.name, 0):
            out[g.eps_field] = out.get(g.eps_field, 0) + g.eps_power * exponents.get(g.name, 0)
    return {k: v for k, v in out.items() if v}


def move_eps_(model: PreTrainedModel, family: Family, groups: list[Group], exponents: dict[str, int]) -> None:
    """Move every norm eps the given group exponents move: the family's and each group's own, where each group's
    `eps` says it lives (the groups that share one eps hold the same holders)."""
    holders = {g.eps_field: g.eps for g in groups if g.eps_power}
    scale_eps_(model, family, holders.get("", ()), eps_exponent(groups, exponents))
    for field, e in scoped_eps_exponents(groups, exponents).items():
        scale_eps_(model, family, holders[field], e)


@torch.no_grad()
def apply_exponents_(model: PreTrainedModel, family: Family, groups: list[Group], exponents: dict[str, int]) -> None:
    """Rescale `model` in place by the given group exponents (missing groups: 0)."""
    weights_of(model).rescale_(tensor_exponents(groups, exponents))
    move_eps_(model, family, groups, exponents)


@contextmanager
def trial(model: PreTrainedModel, family: Family, groups: list[Group], exponents: dict[str, int]):
    """`with trial(model, family, groups, exps): ...` runs the block on the rescaled model, then undoes the rescale
    bit for bit: power-of-two factors invert exactly, `(1+w)` gains are put back as they were (`Weights.snapshot`)."""
    restore = weights_of(model).snapshot(name for name, entries in tensor_exponents(groups, exponents).items()
                                         if any(kind == GAIN1P for kind, _, _ in entries))
    apply_exponents_(model, family, groups, exponents)
    try:
        yield model
    finally:
        apply_exponents_(model, family, groups, {k: -v for k, v in exponents.items()})
        restore()


def scale_eps_(model: PreTrainedModel, family: Family, where: tuple[EpsHolders, ...], exponent: int) -> None:
    """Move one norm eps by 2**exponent, in the configs and norms that hold it (`where`: groups.resolve_eps)."""
    if not exponent:
        return
    for holders in where:
        _scale_eps_holders(model, family, holders, 2.0 ** exponent)


def _under(name: str, prefixes) -> bool:
    """`name` is one of the module names in `prefixes`, or inside one of them."""
    return any(within(name, p) for p in prefixes)


def _scale_eps_holders(model: PreTrainedModel, family: Family, holders: EpsHolders, factor: float) -> None:
    """The eps fields of the holders' configs, the same fields in the configs its sub-models keep (only copies of
    the same value, with `copies_only`), and every covered norm that copied one of them at construction."""
    covered = [(n, m) for n, m in model.named_modules()
               if (not holders.modules or _under(n, holders.modules)) and not _under(n, holders.keep)]
    roots = list({id(c): c for c in (config_at(model.config, p) for p in holders.configs)}.values())
    kept = [m.config for _, m in covered if isinstance(getattr(m, "config", None), PretrainedConfig)]
    olds: set[float] = set()
    for attr in holders.attrs:
        values = {getattr(c, attr) for c in roots if getattr(c, attr, None) is not None}
        configs = roots + [c for c in kept if not holders.copies_only or getattr(c, attr, None) in values]
        for c in {id(c): c for c in configs}.values():
            old = getattr(c, attr, None)
            if old is not None:
                setattr(c, attr, old * factor)
                olds.add(old)
    for name, module in covered:
        if holders.fixed and name.endswith(holders.fixed):
            continue
        for mattr in family.eps_module_attrs:
            value = getattr(module, mattr, None)
            if isinstance(value, float) and value in olds:
                setattr(module, mattr, value * factor)
