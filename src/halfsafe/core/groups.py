"""Family data made concrete for one model: each group's exact tensors, validated loudly.

Every non-optional template must match, and the per-block templates of one group must match the same
blocks, so a mapping that silently matched nothing (or only some layers) fails here, by name.

Block placeholders (families/spec.py) and their rules:
- `{i}`: templates of one group naming the same block list must match the same blocks (in a whole-model
  group, templates in different lists, e.g. encoder and decoder layers, may differ in depth).
- `{i+1}` (per-block groups): the group of block i also moves parameters of block i+1. Such a spec makes
  one group for every block of its `{i}` templates but the last; those blocks must be consecutive and
  every non-optional `{i+1}` template must match exactly the blocks after them (block 1..n-1), or expand
  fails. The group's `span` names both blocks.
- `{last}` (whole-model groups): the highest index the template matches, which must be the last element
  of its ModuleList (a template that matched only the first layers fails).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import UnsupportedModelError
from ..families import Family, GroupSpec, Move
from ..families.spec import BLOCK, LAST_BLOCK, NEXT_BLOCK, EpsScope, placeholder


@dataclass(frozen=True)
class TensorMove:
    param: str
    power: int
    kind: str
    select: tuple[int, object] | None = None  # (dim, slice or index tensor), resolved for this model


@dataclass(frozen=True)
class EpsHolders:
    """One norm eps in one model, as rewrite moves it: an `EpsScope` resolved by `resolve_eps`, its config paths
    and module names as this model names them.

    configs: dotted paths from the model's config to the configs holding the eps ("" the model's config itself).
    attrs: the eps fields there that move (a config lacking one is skipped).
    modules: module-name prefixes whose norms (and the configs their sub-models keep) read it; () every module.
    keep: prefixes inside those whose norms keep an eps of their own.
    fixed: module-name suffixes of norms whose eps the modeling code fixes: never moves.
    copies_only: a config a covered sub-model keeps moves only where it holds the value of `configs` (a copy);
        False: every such config that holds the field (the model's eps, held by its stacks or halves)."""

    configs: tuple[str, ...]
    attrs: tuple[str, ...]
    modules: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()
    copies_only: bool = True


@dataclass(frozen=True)
class Group:
    name: str  # "residual" or "vo@model.layers.3"
    spec: str
    block: str | None  # module prefix of the block a per-block group lives in
    moves: tuple[TensorMove, ...]
    eps_power: int = 0
    # Every block a per-block group moves parameters in: its own and, with `{i+1}` templates, the next
    # one. Empty means just `block` (probe attributes measured activations to groups by these blocks).
    span: tuple[str, ...] = ()
    # Where the eps that eps_power moves lives in this model (resolve_eps): the family's, or, with `eps_field`
    # ("vision_config.layer_norm_eps", as the plan records it), the group's own.
    eps: tuple[EpsHolders, ...] = ()
    eps_field: str = ""
    expert: int | None = None  # a per_expert group's expert (its activations: stats sites "...:expert<e>")

    @property
    def blocks(self) -> tuple[str, ...]:
        return self.span or ((self.block,) if self.block is not None else ())


def _template_regex(template: str) -> re.Pattern:
    ph = placeholder(template)
    assert ph is not None  # _matches calls this for templates with a placeholder only
    return re.compile("^" + re.escape(template).replace(re.escape(ph), r"(\d+)") + "$")


def _strip_base_prefix(model: PreTrainedModel, template: str) -> str:
    """Templates name parameters of the model with a head (`model.layers...`); a bare base model
    (`AutoModel`) has the same parameters without the leading `<base_model_prefix>.`."""
    prefix = f"{model.base_model_prefix}."
    if getattr(model, "base_model", None) is model and template.startswith(prefix):
        return template[len(prefix):]
    return template


def _matches(move: Move, model: PreTrainedModel, names: list[str]) -> dict[str, str]:
    """group index -> parameter name: the block index for {i}; for {i+1}, the index of the block before
    the one matched (the group it belongs to); '' for templates without a placeholder and for {last}."""
    template = _strip_base_prefix(model, move.param)
    ph = placeholder(template)
    if ph is None:
        return {"": template} if template in names else {}
    rx = _template_regex(template)
    found = {m.group(1): n for n in names if (m := rx.match(n))}
    if ph == NEXT_BLOCK:
        return {str(int(k) - 1): n for k, n in found.items()}
    if ph == LAST_BLOCK:
        if not found:
            return {}
        last = max(found, key=int)
        _check_last(move, model, template, int(last))
        return {"": found[last]}
    return found


def _check_last(move: Move, model: PreTrainedModel, template: str, index: int) -> None:
    """{last} must resolve to the final element of its ModuleList."""
    prefix = template[: template.index(LAST_BLOCK)].rstrip(".")
    try:
        container = model.get_submodule(prefix)
    except AttributeError:
        container = None
    size = len(container) if isinstance(container, nn.ModuleList) else None
    if size != index + 1:
        raise UnsupportedModelError(
            f"{move.param!r}: {{last}} matched block {index} of {prefix}, which "
            + (f"has {size} blocks" if size is not None else "is not a list of blocks")
            + f"; this {type(model).__name__} is laid out differently from the family data"
        )


def _resolve_select(move: Move, model: PreTrainedModel, expert: int | None = None):
    """(dim, index) for one part of a tensor; for one expert's part of a fused expert tensor, a tuple of
    such pairs, the expert's own first: ((expert dim, slice(e, e + 1)), (dim, index))."""
    part = None
    if move.select is not None:
        dim, fn = move.select
        index = fn(model.config)
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        part = (dim, index)
    if move.expert is None:
        return part
    assert expert is not None  # a per_expert group's moves (the only ones with Move.expert) come with their expert
    own = (move.expert, slice(expert, expert + 1))
    return (own,) if part is None else (own, part)


def select_parts(select) -> tuple:
    """A TensorMove's select as a tuple of (dim, index) pairs (empty: the whole tensor)."""
    if select is None:
        return ()
    return (select,) if isinstance(select[0], int) else tuple(select)


def _expert_count(family: Family, spec: GroupSpec, moves: list[Move], matched: dict, i: str, model: PreTrainedModel) -> int:
    """How many experts the fused tensors of block i stack (every move of the group must agree)."""
    params = dict(model.named_parameters())
    # GroupSpec checks that every move of a per_expert group names its expert dim
    sizes = {matched[m][i]: params[matched[m][i]].shape[cast(int, m.expert)] for m in moves}
    if len(set(sizes.values())) != 1:
        raise UnsupportedModelError(
            f"family {family.name}, group {spec.name}: the expert tensors of block {i} stack different numbers of "
            f"experts ({sizes}); this {type(model).__name__} is laid out differently from the family data"
        )
    return next(iter(sizes.values()))


def expand(family: Family, model: PreTrainedModel) -> list[Group]:
    names = [n for n, _ in model.named_parameters()]
    groups: list[Group] = []
    for spec in family.groups:
        if spec.when is not None and not spec.when(model):
            continue
        moves = [m for m in spec.moves if m.when is None or m.when(model)]
        matched = {m: _matches(m, model, names) for m in moves}
        if spec.blocks is not None:  # the family data allows this per-block group in these blocks only
            allowed = {str(i) for i in spec.blocks(model)}
            if not allowed:
                continue
            matched = {m: {i: n for i, n in found.items() if i in allowed} for m, found in matched.items()}
        for m in moves:
            # {i+1} templates legitimately match nothing in a one-block model; _successor_blocks checks them.
            if not matched[m] and not m.optional and placeholder(m.param) != NEXT_BLOCK:
                raise UnsupportedModelError(
                    f"family {family.name}, group {spec.name}: no parameter matches {m.param!r}; "
                    f"this {type(model).__name__} is laid out differently from the family data (families/{family.name}.py)"
                )
        _check_same_blocks(family, spec, moves, matched)
        if spec.per_block:
            own = [m for m in moves if placeholder(m.param) == BLOCK]
            blocks = sorted({i for m in own if not m.optional for i in matched[m]}, key=int)
            following = [m for m in moves if placeholder(m.param) == NEXT_BLOCK]
            if following:
                blocks = _successor_blocks(family, spec, blocks, following, matched)
            for i in blocks:
                here = [m for m in moves if i in matched[m]]
                block = _block_prefix(own[0].param, model, i)
                span = tuple(dict.fromkeys(_block_prefix(m.param, model, i) for m in here))
                if spec.per_expert:
                    for e in range(_expert_count(family, spec, here, matched, i, model)):
                        tm = tuple(TensorMove(matched[m][i], m.power, m.kind, _resolve_select(m, model, e)) for m in here)
                        groups.append(Group(f"{spec.name}@{block}#{e}", spec.name, block, tm, span=span, expert=e))
                    continue
                tm = tuple(TensorMove(matched[m][i], m.power, m.kind, _resolve_select(m, model)) for m in here)
                groups.append(Group(f"{spec.name}@{block}", spec.name, block, tm, span=span))
        else:
            tm = tuple(TensorMove(name, m.power, m.kind, _resolve_select(m, model)) for m in moves for _, name in sorted(matched[m].items(), key=lambda kv: int(kv[0] or -1)))
            eps, field = _group_eps(family, model, spec)
            groups.append(Group(spec.name, spec.name, None, tm, spec.eps_power, eps=eps, eps_field=field))
    _check_kinds(family, groups)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for g in groups:
        _check_disjoint_parts(family, g, shapes)
    return groups


def _group_eps(family: Family, model: PreTrainedModel, spec: GroupSpec) -> tuple[tuple[EpsHolders, ...], str]:
    """Where a whole-model group's eps_power moves a norm eps in `model`, and the config field the plan records it
    by: the group's own ("vision_config.layer_norm_eps"), or "" for the family's."""
    if spec.eps is not None:
        return resolve_eps(family, model, (spec.eps,)), f"{spec.eps.configs[0]}.{spec.eps.attrs[0]}"
    return (resolve_eps(family, model) if spec.eps_power else ()), ""


def _block_prefix(template: str, model: PreTrainedModel, i: str) -> str:
    """The block a template names for group index i: `<list>.<i>` ({i}) or `<list>.<i+1>` ({i+1})."""
    template = _strip_base_prefix(model, template)
    ph = placeholder(template)
    assert ph is not None  # called for per-block templates, which hold {i} or {i+1}
    return template[: template.index(ph)] + (str(int(i) + 1) if ph == NEXT_BLOCK else i)


def _list_prefix(template: str) -> str:
    ph = placeholder(template)
    assert ph is not None  # called for {i} templates only
    return template[: template.index(ph)]


def _check_same_blocks(family: Family, spec: GroupSpec, moves: list[Move], matched: dict) -> None:
    per_block = [m for m in moves if placeholder(m.param) == BLOCK and not m.optional]
    # A per-block group has one index for all its templates; a whole-model group may read two block lists
    # of different depth (encoder and decoder), each of which must be matched consistently.
    by_list: dict[str, dict[str, set]] = {}
    for m in per_block:
        by_list.setdefault("" if spec.per_block else _list_prefix(m.param), {})[m.param] = set(matched[m])
    for sets in by_list.values():
        if len({frozenset(s) for s in sets.values()}) > 1:
            detail = "; ".join(f"{p}: {len(s)} blocks" for p, s in sets.items())
            raise UnsupportedModelError(
                f"family {family.name}, group {spec.name}: templates match different blocks ({detail}); "
                "a rescale that skips a layer would change the model"
            )


def _successor_blocks(family: Family, spec: GroupSpec, blocks: list[str], following: list[Move], matched: dict) -> list[str]:
    """The blocks of a spec with {i+1} templates: all of its {i} blocks but the last, which must be
    consecutive, and whose successors every non-optional {i+1} template matches, no more and no less
    (its match in the first block, which has no predecessor here, belongs to no group of this spec)."""
    ints = [int(i) for i in blocks]
    if ints and ints != list(range(ints[0], ints[0] + len(ints))):
        raise UnsupportedModelError(
            f"family {family.name}, group {spec.name}: {{i+1}} needs consecutive blocks, the templates match {ints}"
        )
    expected = set(blocks[:-1])
    for m in following:
        got = {i for i in matched[m] if ints and int(i) >= ints[0]}
        if got != expected and not (m.optional and got <= expected):
            raise UnsupportedModelError(
                f"family {family.name}, group {spec.name}: {m.param!r} matches blocks "
                f"{sorted(int(i) + 1 for i in got)}, expected {sorted(int(i) + 1 for i in expected)} (every block after the "
                "first); a rescale that skips a layer would change the model"
            )
    return blocks[:-1]


def _check_disjoint_parts(family: Family, group: Group, shapes: dict) -> None:
    """Parts of one tensor selected within a group must not overlap (an overlap would move twice)."""
    # A part is a box: per dim, the indices it takes (None: all of them). Two boxes overlap where they
    # share indices in every dim.
    seen: dict[str, list[dict[int, set[int]]]] = {}
    for m in group.moves:
        if m.select is None:
            continue
        shape = shapes[m.param]
        box = {dim: set(range(*index.indices(shape[dim]))) if isinstance(index, slice) else set(index.tolist())
               for dim, index in select_parts(m.select)}
        for other in seen.setdefault(m.param, []):
            if all(box[d] & other[d] for d in box.keys() & other.keys()):
                raise ValueError(f"family {family.name}, group {group.name}: parts of {m.param} selected twice overlap")
        seen[m.param].append(box)


def _check_kinds(family: Family, groups: list[Group]) -> None:
    kinds: dict[str, str] = {}
    for g in groups:
        for m in g.moves:
            if kinds.setdefault(m.param, m.kind) != m.kind:
                raise ValueError(f"family {family.name}: {m.param} is moved both as {kinds[m.param]} and {m.kind}")


def resolve_eps(family: Family, model: PreTrainedModel, scopes: tuple[EpsScope, ...] | None = None) -> tuple[EpsHolders, ...]:
    """Where the eps of `scopes` (None: the family's, `Family.eps`) lives in `model`: the scopes that apply to it (with
    a config field to move) as `EpsHolders`, module names as `model` names them. A config a scope names must exist
    and hold one of its fields, or this fails in one line."""
    return tuple(_holders(family, model, s) for s in (family.eps if scopes is None else scopes)
                 if s.attrs and (s.when is None or s.when(model)))


def _module_names(model: PreTrainedModel, prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """Module-name prefixes as `model` names them (in a bare base model, the base model's own name is "")."""
    return tuple(_strip_base_prefix(model, p + ".")[:-1] for p in prefixes)


def _holders(family: Family, model: PreTrainedModel, scope: EpsScope) -> EpsHolders:
    modules, keep = _module_names(model, scope.modules), _module_names(model, scope.keep)
    if not scope.configs:  # the whole model: its config, its text config and the stacks' copies
        text = _config_path(model.config, model.config.get_text_config())
        return EpsHolders(tuple(dict.fromkeys(("", text))), scope.attrs, modules, keep, scope.fixed, copies_only=False)
    for path in scope.configs:
        try:
            config = config_at(model.config, path)
        except AttributeError:
            config = None
        if not any(getattr(config, a, None) is not None for a in scope.attrs):
            fields = " or ".join(f"{path}.{a}" if path else a for a in scope.attrs)
            raise UnsupportedModelError(f"family {family.name}: this {type(model).__name__}'s config has no {fields} for "
                                        f"its norm eps to move (families/{family.name}.py)")
    return EpsHolders(scope.configs, scope.attrs, modules, keep, scope.fixed)


def config_at(config, path: str):
    """The sub-config at a dotted path ("" is `config` itself)."""
    for part in path.split(".") if path else ():
        config = getattr(config, part)
    return config


def _config_path(config, target) -> str:
    """The dotted path from `config` to its sub-config `target` ("" for `config` itself)."""
    todo, seen = [("", config)], set()
    while todo:
        path, c = todo.pop(0)
        if c is target:
            return path
        seen.add(id(c))
        todo += [(f"{path}.{k}" if path else k, v) for k, v in vars(c).items() if isinstance(v, PretrainedConfig) and id(v) not in seen]
    raise UnsupportedModelError(f"{type(config).__name__}: its text config is not one of its sub-configs")
