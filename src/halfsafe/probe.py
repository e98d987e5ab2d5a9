"""Measure, rather than assume, which activations each group moves.

Each group spec is applied with exponent -1 (the direction plans go) on a short input; every measured
tensor whose peak halves (or doubles) is governed by that group with power +1 (-1). The same run proves the group exact: the
model's output must not change. Family data that is wrong for this model fails here, loudly.
The groups of one spec are scaled together, in one pass, unless some share a block (a post-norm group
spanning blocks i and i+1): then in as few passes as keep every measured activation's owner unambiguous.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from transformers import PreTrainedModel

from .errors import UnsupportedModelError
from .families import Family
from .forward import logits as forward_logits
from .groups import Group
from .rewrite import trial
from .sites import Site, block_of
from .stats import ActivationCollector

EXACT_RTOL = 1e-4  # float32 output change allowed for a probe (exact algebra; only eps rounding differs)
_POWER_TOL = 1e-3
PROBE_EXPONENT = -1


@torch.no_grad()
def _measure(model: PreTrainedModel, ids: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    with ActivationCollector(model) as c:
        out = forward_logits(model, ids)
    return {k: s.abs_max for k, s in c.sites.items()}, out


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
            after = moved.get(site, before)
            if not (before > 0 and math.isfinite(before) and math.isfinite(after)):
                continue
            power = (math.log2(after / before) if after > 0 else -math.inf) / PROBE_EXPONENT
            if abs(power) < _POWER_TOL:
                continue
            owner = _owner(site, members)
            if owner is None:
                raise UnsupportedModelError(
                    f"family {family.name}, group {spec}: it moves {site}, outside the blocks (and experts) it was declared in"
                )
            # A tensor only partly moved (a fused projection) may not move by a whole power: planning
            # counts on the part that does not move.
            governed[owner][site] = round(power) if abs(power - round(power)) < _POWER_TOL else 0.0
    return governed


def _passes(members: list[Group]) -> list[list[Group]]:
    """Split one spec's groups so that no two groups scaled together share a block. Groups inside one
    block each (every pre-norm pair) all go in one pass; groups spanning blocks i and i+1 take two.
    The experts of one block share it but not their sites ("...:expert<e>"): they go in one pass."""
    passes: list[tuple[set[str], list[Group]]] = []
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
