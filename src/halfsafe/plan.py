"""Statistics -> a plan: one power-of-two exponent per group, chosen so every activation the plan can
move sits at least `headroom_bits` under float16's maximum. Pure functions over measured numbers."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .families import GAIN1P
from .formats import FP16_MAX
from .groups import Group
from .rewrite import eps_exponent, tensor_exponents
from .stats import SiteStats

FP16_MAX_BITS = math.log2(FP16_MAX)
MIN_EXPONENT = -24  # below this a scale pushes ordinary weights into fp16 subnormals


@dataclass
class Constraint:
    """log2(peak) + sum(power[g] * exponent[g]) must stay <= the limit."""

    site: str
    log2_peak: float
    powers: dict[str, float]


def constraints_from(sites: dict[str, SiteStats], governed: dict[str, dict[str, float]], groups: list[Group], params: dict[str, torch.Tensor]) -> list[Constraint]:
    """Measured activations plus every moved weight (a weight must fit fp16 too)."""
    powers_by_site: dict[str, dict[str, float]] = {}
    for g, sites_moved in governed.items():
        for site, p in sites_moved.items():
            if p:
                powers_by_site.setdefault(site, {})[g] = p
    out = [
        Constraint(name, math.log2(s.abs_max), powers_by_site.get(name, {}))
        for name, s in sites.items()
        if s.abs_max > 0
    ]
    weight_powers: dict[str, dict[str, float]] = {}
    for g in groups:
        for m in g.moves:
            weight_powers.setdefault(m.param, {})
            weight_powers[m.param][g.name] = weight_powers[m.param].get(g.name, 0) + m.power
    for name, powers in weight_powers.items():
        t = params[name].detach()
        kind = next(m.kind for g in groups for m in g.moves if m.param == name)
        peak = float((1 + t.double()).abs().max()) if kind == GAIN1P else float(t.abs().max())
        if peak > 0:
            out.append(Constraint(f"weight:{name}", math.log2(peak), {k: v for k, v in powers.items() if v}))
    return out


def predicted_log2(c: Constraint, exponents: dict[str, int]) -> float:
    return c.log2_peak + sum(p * exponents.get(g, 0) for g, p in c.powers.items())


def solve(groups: list[Group], constraints: list[Constraint], headroom_bits: float, fixed: dict[str, int] | None = None) -> dict[str, int]:
    """Largest exponents <= 0 meeting every constraint a group can influence.

    A constraint with a positive power caps a group's exponent from above; one with a negative power
    (the K side of a Q/K pair, a consumer weight that grows as its producer shrinks) bounds it from
    below. Where the two cross, no exponent of that group meets both, and it settles halfway; the
    report then names what still overflows."""
    limit = FP16_MAX_BITS - headroom_bits
    exps = {g.name: 0 for g in groups}
    exps.update(fixed or {})
    free = [g.name for g in groups if g.name not in (fixed or {})]
    by_group: dict[str, list[Constraint]] = {g: [] for g in exps}
    for c in constraints:
        for g, p in c.powers.items():
            if p and g in by_group:
                by_group[g].append(c)
    for _ in range(100):
        changed = False
        for g in free:
            upper, lower = 0, MIN_EXPONENT
            for c in by_group[g]:
                p = c.powers[g]
                slack = limit - (predicted_log2(c, exps) - p * exps[g])
                if p > 0:
                    upper = min(upper, math.floor(slack / p + 1e-9))
                else:
                    lower = max(lower, math.ceil(slack / p - 1e-9))
            best = max(upper, MIN_EXPONENT) if upper >= lower else math.floor((upper + lower) / 2)
            if best != exps[g]:
                exps[g] = best
                changed = True
        if not changed:
            break
    return exps


@dataclass
class Plan:
    """A serialisable plan: the exponent of each group of `family` (0 for groups not listed)."""

    family: str
    model_type: str
    exponents: dict[str, int]
    headroom_bits: float
    tensors: list[dict] = field(default_factory=list)  # every touched tensor with its exponent
    eps_exponent: int = 0
    context_length: int | None = None  # the longest context `headroom_bits` was chosen for (halfsafe.margin)

    @classmethod
    def build(cls, family: str, model_type: str, groups: list[Group], exponents: dict[str, int], headroom_bits: float,
              context_length: int | None = None) -> "Plan":
        exps = {k: int(v) for k, v in exponents.items() if v}
        tensors = [
            {"param": p, "kind": kind, "exponent": e, "part": _describe_select(select)}
            for p, entries in tensor_exponents(groups, exps).items()
            for kind, e, select in entries
        ]
        return cls(family, model_type, exps, headroom_bits, tensors, eps_exponent(groups, exps), context_length)

    def inverse(self) -> "Plan":
        inv = {k: -v for k, v in self.exponents.items()}
        tensors = [dict(t, exponent=-t["exponent"]) for t in self.tensors]
        return Plan(self.family, self.model_type, inv, self.headroom_bits, tensors, -self.eps_exponent, self.context_length)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(d["family"], d["model_type"], {k: int(v) for k, v in d["exponents"].items()}, float(d["headroom_bits"]),
                   d.get("tensors", []), int(d.get("eps_exponent", 0)), d.get("context_length"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        d = json.loads(Path(path).read_text())
        return cls.from_dict(d.get("plan", d))


def _describe_select(select) -> str | None:
    if select is None:
        return None
    dim, index = select
    if isinstance(index, slice):
        return f"dim {dim} [{index.start}:{index.stop}]"
    return f"dim {dim}, {len(index)} indices"
