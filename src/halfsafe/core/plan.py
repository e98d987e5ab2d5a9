"""Statistics -> a plan: one power-of-two exponent per group, chosen so every activation the plan can
move sits at least `headroom_bits` under float16's maximum. Pure functions over measured numbers."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .._version import __version__
from ..errors import HalfsafeError
from ..families import GAIN1P
from ..files.filetypes import kind as file_kind
from .formats import FP16_MAX
from .groups import Group, TensorMove, select_parts
from .plan_schema import (
    MIN_EXPONENT,  # below this a scale pushes ordinary weights into fp16 subnormals
    validate,
)
from .rewrite import eps_exponent, scoped_eps_exponents, select_key, tensor_exponents
from .stats import SiteStats
from .weights import part_index, value_blocks

FP16_MAX_BITS = math.log2(FP16_MAX)


@dataclass
class Constraint:
    """log2(peak) + sum(power[g] * exponent[g]) must stay <= the limit."""

    site: str
    log2_peak: float
    powers: dict[str, float]


def constraints_from(sites: dict[str, SiteStats], governed: dict[str, dict[str, float]], groups: list[Group], params: Mapping[str, torch.Tensor]) -> list[Constraint]:
    """Measured activations plus every moved weight (a weight must fit fp16 too). `params`: each parameter's
    current value by name (`weights_of(model).values()`, read a block of rows at a time where it offers that)."""
    return site_constraints(sites, governed) + weight_constraints(groups, params)


def site_constraints(sites: dict[str, SiteStats], governed: dict[str, dict[str, float]]) -> list[Constraint]:
    """The measured activations' constraints (`constraints_from`'s first part)."""
    powers_by_site: dict[str, dict[str, float]] = {}
    for group_name, sites_moved in governed.items():
        for site, p in sites_moved.items():
            if p:
                powers_by_site.setdefault(site, {})[group_name] = p
    bad = next((name for name, s in sites.items() if not math.isfinite(s.abs_max)), None)
    if bad is not None:
        raise HalfsafeError(f"{bad} is non-finite even in float32: the model's weights are corrupt (or its inputs); "
                            "re-download or re-save the checkpoint")
    return [
        Constraint(name, math.log2(s.abs_max), powers_by_site.get(name, {}))
        for name, s in sites.items()
        if s.abs_max > 0
    ]


def weight_constraints(groups: list[Group], params: Mapping[str, torch.Tensor]) -> list[Constraint]:
    """Every moved weight's constraint (`constraints_from`'s second part): its peak, read from `params`."""
    out: list[Constraint] = []
    moves: dict[str, list[tuple[str, TensorMove]]] = {}  # param -> [(group, move)]
    for g in groups:
        for m in g.moves:
            moves.setdefault(m.param, []).append((g.name, m))
    for name, entries in moves.items():
        if all(m.select is None for _, m in entries):
            out += _weight_constraint(f"weight:{name}", value_blocks(params, name), entries)
            continue
        t = params[name].detach()
        # Moved in parts (a fused projection's rows, one expert's slice): each part's own peak, moved by the
        # groups that move that part or the whole tensor (summing every part's exponent on the whole
        # tensor's peak would let one expert's pair hold back all the others).
        whole = [(g, m) for g, m in entries if m.select is None]
        if whole:
            out += _weight_constraint(f"weight:{name}", t, whole)
        parts = list(dict.fromkeys(select_key(m.select) for _, m in entries if m.select is not None))
        for key in parts:
            select = next(m.select for _, m in entries if select_key(m.select) == key)
            here = [(g, m) for g, m in entries if m.select is None or _overlap(m.select, select)]
            out += _weight_constraint(f"weight:{name}[{_describe_select(select)}]", t[part_index(t, select)], here)
    return out


def _weight_constraint(site: str, t, entries: list) -> list[Constraint]:
    powers: dict[str, float] = {}
    for g, m in entries:
        powers[g] = powers.get(g, 0) + m.power
    kind = entries[0][1].kind
    blocks = [t] if isinstance(t, torch.Tensor) else t  # a tensor, or its blocks of rows
    peak = max((float((1 + b.detach().double()).abs().max()) if kind == GAIN1P else _abs_max(b) for b in blocks if b.numel()),
               default=0.0)
    return [Constraint(site, math.log2(peak), {k: v for k, v in powers.items() if v})] if peak > 0 else []


def _abs_max(t: torch.Tensor) -> float:
    """max |t| without a full-size temporary (a 168M-entry embedding would need 0.7 GB for t.abs())."""
    low, high = torch.aminmax(t.detach())
    return max(float(high), -float(low))


def _overlap(a, b) -> bool:
    """Two parts of one tensor share an entry: in every dim both select, their indices meet."""
    da = {d: _indices(i) for d, i in select_parts(a)}
    db = {d: _indices(i) for d, i in select_parts(b)}
    return all(da[d] & db[d] for d in da.keys() & db.keys())


def _indices(index) -> set:
    if isinstance(index, slice):
        return set(range(index.start or 0, index.stop, index.step or 1))
    return set(index.tolist())


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


def solve_peaks(groups: list[Group], peaks: dict[str, float], governed: dict[str, dict[str, float]],
                params: dict[str, torch.Tensor], headroom_bits: float) -> dict[str, int]:
    """The solver's exponents (the non-zero ones) for sampled peaks (site -> |x| max, each finite): the plan the
    constraints of those peaks and of every moved weight give, as `convert` solves its reference plan. For peaks
    measured without a scan's statistics (training's `PeakSampler`)."""
    sites = {s: SiteStats(s, "", abs_max=p) for s, p in peaks.items()}
    return {k: v for k, v in solve(groups, constraints_from(sites, governed, groups, params), headroom_bits).items() if v}


def movable(governed: dict[str, dict[str, float]]) -> set[str]:
    """The sites some group moves (what a plan can lower); the rest only a fine-tune reaches."""
    return {s for moved in governed.values() for s, p in moved.items() if p}


PLAN_FORMAT = 2  # 1: no version field (halfsafe 0.1.0); 2: versioned, every tensor with its shape


@dataclass
class Plan:
    """A serialisable plan: the exponent of each group of `family` (0 for groups not listed), and as data what
    that means for this architecture: every touched tensor (name, kind, exponent, part, shape) and eps change.
    `apply_plan_` refuses a plan whose tensors today's family data would map differently."""

    family: str
    model_type: str
    exponents: dict[str, int]
    headroom_bits: float
    tensors: list[dict] = field(default_factory=list)  # every touched tensor with its exponent
    eps_exponent: int = 0
    eps_fields: dict[str, int] = field(default_factory=dict)  # eps of their own (a tower's): config field -> exponent
    context_length: int | None = None  # the longest context `headroom_bits` was chosen for (halfsafe.core.margin)
    format: int = PLAN_FORMAT
    halfsafe_version: str = ""

    @classmethod
    def build(cls, family: str, model_type: str, groups: list[Group], exponents: dict[str, int], headroom_bits: float,
              context_length: int | None = None, shapes: dict[str, tuple] | None = None) -> "Plan":
        exps = {k: int(v) for k, v in exponents.items() if v}
        return cls(family, model_type, exps, headroom_bits, tensor_table(groups, exps, shapes), eps_exponent(groups, exps),
                   scoped_eps_exponents(groups, exps), context_length,
                   PLAN_FORMAT, __version__)

    def inverse(self) -> "Plan":
        inv = {k: -v for k, v in self.exponents.items()}
        tensors = [dict(t, exponent=-t["exponent"]) for t in self.tensors]
        return Plan(self.family, self.model_type, inv, self.headroom_bits, tensors, -self.eps_exponent,
                    {k: -v for k, v in self.eps_fields.items()}, self.context_length, self.format, self.halfsafe_version)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A plan read from a file, refused in one line unless `plan_schema.validate` accepts it."""
        d = validate(d, PLAN_FORMAT)
        return cls(d["family"], d["model_type"], dict(d["exponents"]), float(d["headroom_bits"]),
                   [dict(t) for t in d["tensors"]], d.get("eps_exponent", 0), dict(d.get("eps_fields", {})),
                   d.get("context_length"), d["format"], d.get("halfsafe_version", ""))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if path.is_dir():
            path = path / "halfsafe.json"
        try:
            mode = os.stat(path).st_mode  # a regular file, before it is opened: a FIFO would hang the read
            if not stat.S_ISREG(mode):
                raise HalfsafeError(f"cannot read a plan from {path} (it is {file_kind(mode)}, not a file): pass a plan.json or a "
                                    "converted folder")
            d = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise HalfsafeError(f"cannot read a plan from {path} ({type(e).__name__}): pass a plan.json or a converted folder") from None
        return cls.from_dict(d.get("plan", d) if isinstance(d, dict) else d)


def tensor_table(groups: list[Group], exponents: dict[str, int], shapes: dict[str, tuple] | None = None) -> list[dict]:
    """Every tensor the exponents touch, as data: name, kind, total exponent, part (and shape, when known)."""
    rows = []
    for p, entries in tensor_exponents(groups, exponents).items():
        for kind, e, select in entries:
            row = {"param": p, "kind": kind, "exponent": e, "part": _describe_select(select)}
            if shapes is not None:
                row["shape"] = list(shapes[p])
            rows.append(row)
    return rows


def _describe_select(select) -> str | None:
    if select is None:
        return None
    return ", ".join(f"dim {dim} [{index.start}:{index.stop}]" if isinstance(index, slice) else f"dim {dim}, {len(index)} indices"
                     for dim, index in select_parts(select))
