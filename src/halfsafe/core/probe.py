"""Measure, rather than assume, which activations each group moves.

Each group spec is applied with exponent -1 (the direction plans go) on a short input; every measured
tensor whose every entry along its last dim halves (or doubles) at its peak is governed by that group with
power +1 (-1). Comparing the peak of each last-dim entry, not only the tensor's peak, tells a fused tensor
(GPT-2's c_attn: q moves, k moves the other way, v stays) from one that moves whole, whatever the weights:
a tensor moved only in part, or not by a whole power, is recorded with power 0. The same run proves the group exact: the
model's output must not change. Family data that is wrong for this model fails here, loudly.
The groups of one spec are scaled together, in one pass, unless some share a block (a post-norm group
spanning blocks i and i+1): then in as few passes as keep every measured activation's owner unambiguous.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from transformers import PreTrainedModel

from ..errors import UnsupportedModelError
from ..families import Family
from .forward import logits as forward_logits
from .groups import Group
from .rewrite import trial
from .sites import Site, block_of
from .stats import ActivationCollector

EXACT_RTOL = 1e-4  # float32 output change allowed for a probe (exact algebra; only eps rounding differs)
# Entries this far under the site's peak are left out: they come from cancellation (attention outputs, sums of
# signed terms), where last-bit differences (a norm's moved eps) are a large part of the value.
_COLUMN_FLOOR = 2.0 ** -8
# How far one entry's move may be from a whole power: a norm whose eps moved rounds its output differently in
# the last bits, and an attention or GELU output after it carries that as up to ~2e-3 of a power (measured on
# tiny Pegasus); 1/64 still tells 0 from +-1 apart by far.
_COLUMN_TOL = 1.0 / 64
PROBE_EXPONENT = -1


@torch.no_grad()
def _measure(model: PreTrainedModel, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """site -> the peak |x| of each entry along its last dim; the model's output."""
    with ActivationCollector(model, columns=True) as c:
        out = forward_logits(model, ids)
    return {k: s.column_max for k, s in c.sites.items() if s.column_max is not None}, out


def _power(before: torch.Tensor, after: torch.Tensor | None) -> float | None:
    """The whole power a site moves by (None: it does not move; 0.0: only in part, or not by a whole power)."""
    if after is None or after.shape != before.shape:
        return None
    finite = torch.isfinite(before) & torch.isfinite(after)
    if not finite.any():
        return None
    seen = finite & (before > 0) & (before >= before[finite].max() * _COLUMN_FLOOR)
    if not seen.any():
        return None
    powers = torch.log2(after[seen].double() / before[seen].double()) / PROBE_EXPONENT
    if bool((powers.abs() < _COLUMN_TOL).all()):
        return None
    whole = round(float(powers[0])) if math.isfinite(float(powers[0])) else 0
    return float(whole) if whole and bool(((powers - whole).abs() < _COLUMN_TOL).all()) else 0.0


def _rel_change(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@torch.no_grad()
def probe(model: PreTrainedModel, family: Family, groups: list[Group], ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """group name -> {site: power}; raises if a group changes the model's output."""
    base, ref = _measure(model, ids)
    by_spec: dict[str, list[Group]] = defaultdict(list)
    for g in groups:
        by_spec[g.spec].append(g)
    governed: dict[str, dict[str, float]] = {g.name: {} for g in groups}
    for spec, members in ((name, part) for name, every in by_spec.items() for part in _passes(every)):
        exps = {g.name: PROBE_EXPONENT for g in members}
        with trial(model, family, members, exps):
            moved, out = _measure(model, ids)
        change = _rel_change(ref, out)
        if not change <= EXACT_RTOL:
            raise UnsupportedModelError(
                f"family {family.name}, group {spec}: scaling it changed this {type(model).__name__}'s output by "
                f"{change:.2e} (relative); the family data does not hold for this model (families/{family.name}.py)"
            )
        for site, before in base.items():
            power = _power(before, moved.get(site))
            if power is None:
                continue
            owner = _owner(site, members)
            if owner is None:
                raise UnsupportedModelError(
                    f"family {family.name}, group {spec}: it moves {site}, outside the blocks (and experts) it was declared in"
                )
            # A tensor only partly moved (a fused projection): planning counts on the part that does not move.
            governed[owner][site] = int(power) if power else 0.0
    return governed


def _passes(members: list[Group]) -> list[list[Group]]:
    """Split one spec's groups so that no two groups scaled together share a block. Groups inside one
    block each (every pre-norm pair) all go in one pass; groups spanning blocks i and i+1 take two.
    The experts of one block share it but not their sites ("...:expert<e>"): they go in one pass."""
    passes: list[tuple[set[tuple[str, int | None]], list[Group]]] = []  # (the (block, expert) pairs used, the groups)
    for g in members:
        blocks = {(b, g.expert) for b in g.blocks}
        for used, together in passes:
            if not blocks & used:
                used |= blocks
                together.append(g)
                break
        else:
            passes.append((blocks, [g]))
    return [together for _, together in passes]


def _owner(site: str, members: list[Group]) -> str | None:
    if len(members) == 1 and members[0].block is None:
        return members[0].name
    where = Site.parse(site)
    block = block_of(where, [b for g in members for b in g.blocks])
    found = [g for g in members if block is not None and block in g.blocks]
    if any(g.expert is not None for g in found):  # one block's experts: the site names its expert, or no one owns it
        found = [g for g in found if g.expert is not None and where.expert == g.expert]
        return found[0].name if len(found) == 1 else None
    return found[0].name if found else None
