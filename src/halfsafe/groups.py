"""Family data made concrete for one model: each group's exact tensors, validated loudly.

Every non-optional template must match, and the per-block templates of one group must match the same
blocks, so a mapping that silently matched nothing (or only some layers) fails here, by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .errors import UnsupportedModelError
from .families import Family, GroupSpec, Move


@dataclass(frozen=True)
class TensorMove:
    param: str
    power: int
    kind: str
    select: tuple[int, object] | None = None  # (dim, slice or index tensor), resolved for this model


@dataclass(frozen=True)
class Group:
    name: str  # "residual" or "vo@model.layers.3"
    spec: str
    block: str | None  # module prefix of the block a per-block group lives in
    moves: tuple[TensorMove, ...]
    eps_power: int = 0


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


def _strip_base_prefix(model: PreTrainedModel, template: str) -> str:
    """Templates name parameters of the model with a head (`model.layers...`); a bare base model
    (`AutoModel`) has the same parameters without the leading `<base_model_prefix>.`."""
    prefix = f"{model.base_model_prefix}."
    if getattr(model, "base_model", None) is model and template.startswith(prefix):
        return template[len(prefix):]
    return template


def _matches(move: Move, model: PreTrainedModel, names: list[str]) -> dict[str, str]:
    """index -> parameter name ('' for templates without {i})."""
    template = _strip_base_prefix(model, move.param)
    if "{i}" not in template:
        return {"": template} if template in names else {}
    rx = _template_regex(template)
    return {m.group(1): n for n in names if (m := rx.match(n))}


def _resolve_select(move: Move, model: PreTrainedModel):
    if move.select is None:
        return None
    dim, fn = move.select
    index = fn(model.config)
    if not isinstance(index, slice):
        index = torch.as_tensor(index, dtype=torch.long)
    return (dim, index)


def expand(family: Family, model: PreTrainedModel) -> list[Group]:
    names = [n for n, _ in model.named_parameters()]
    groups: list[Group] = []
    for spec in family.groups:
        if spec.when is not None and not spec.when(model):
            continue
        moves = [m for m in spec.moves if m.when is None or m.when(model)]
        matched = {m: _matches(m, model, names) for m in moves}
        for m in moves:
            if not matched[m] and not m.optional:
                raise UnsupportedModelError(
                    f"family {family.name}, group {spec.name}: no parameter matches {m.param!r}; "
                    f"this {type(model).__name__} is laid out differently from the family data (families/{family.name}.py)"
                )
        _check_same_blocks(family, spec, moves, matched)
        if spec.per_block:
            blocks = sorted({i for m in moves if not m.optional for i in matched[m]}, key=int)
            for i in blocks:
                tm = tuple(TensorMove(matched[m][i], m.power, m.kind, _resolve_select(m, model)) for m in moves if i in matched[m])
                block = _block_prefix(moves[0].param, model, i)
                groups.append(Group(f"{spec.name}@{block}", spec.name, block, tm))
        else:
            tm = tuple(TensorMove(name, m.power, m.kind, _resolve_select(m, model)) for m in moves for _, name in sorted(matched[m].items(), key=lambda kv: int(kv[0] or -1)))
            groups.append(Group(spec.name, spec.name, None, tm, spec.eps_power))
    _check_kinds(family, groups)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for g in groups:
        _check_disjoint_parts(family, g, shapes)
    return groups


def _block_prefix(template: str, model: PreTrainedModel, i: str) -> str:
    template = _strip_base_prefix(model, template)
    return template[: template.index("{i}")] + i


def _check_same_blocks(family: Family, spec: GroupSpec, moves: list[Move], matched: dict) -> None:
    per_block = [m for m in moves if "{i}" in m.param and not m.optional]
    sets = {m.param: set(matched[m]) for m in per_block}
    if len({frozenset(s) for s in sets.values()}) > 1:
        detail = "; ".join(f"{p}: {len(s)} blocks" for p, s in sets.items())
        raise UnsupportedModelError(
            f"family {family.name}, group {spec.name}: templates match different blocks ({detail}); "
            "a rescale that skips a layer would change the model"
        )


def _check_disjoint_parts(family: Family, group: Group, shapes: dict) -> None:
    """Parts of one tensor selected within a group must not overlap (an overlap would move twice)."""
    seen: dict[tuple[str, int], set[int]] = {}
    for m in group.moves:
        if m.select is None:
            continue
        dim, index = m.select
        size = shapes[m.param][dim]
        rows = set(range(*index.indices(size))) if isinstance(index, slice) else set(index.tolist())
        taken = seen.setdefault((m.param, dim), set())
        if rows & taken:
            raise ValueError(f"family {family.name}, group {group.name}: parts of {m.param} selected twice overlap")
        taken |= rows


def _check_kinds(family: Family, groups: list[Group]) -> None:
    kinds: dict[str, str] = {}
    for g in groups:
        for m in g.moves:
            if kinds.setdefault(m.param, m.kind) != m.kind:
                raise ValueError(f"family {family.name}: {m.param} is moved both as {kinds[m.param]} and {m.kind}")
