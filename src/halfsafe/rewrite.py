"""The one place that mutates weights: scale each group's tensors by 2**(exponent * power).

Power-of-two multiplications are exact in any binary float format (barring overflow or subnormals), so
applying exponents and then their negation restores `mul` tensors bit for bit. `(1+w)` gains are
computed in float64 and rounded once to the parameter's dtype.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import PretrainedConfig, PreTrainedModel

from .families import GAIN1P, MUL, Family
from .groups import Group, select_parts


def tensor_exponents(groups: list[Group], exponents: dict[str, int]) -> dict[str, list[tuple[str, int, object]]]:
    """param -> [(kind, total exponent, select)], merging every group that moves the same tensor part."""
    merged: dict[str, dict] = defaultdict(dict)
    for g in groups:
        e = exponents.get(g.name, 0)
        if not e:
            continue
        for m in g.moves:
            key = (m.kind, _select_key(m.select))
            kind, total, select = merged[m.param].get(key, (m.kind, 0, m.select))
            merged[m.param][key] = (kind, total + e * m.power, select)
    return {p: [v for v in entries.values() if v[1]] for p, entries in merged.items() if any(v[1] for v in entries.values())}


def _select_key(select) -> object:
    if select is None:
        return None
    parts = tuple((dim, (index.start, index.stop, index.step) if isinstance(index, slice) else tuple(index.tolist()))
                  for dim, index in select_parts(select))
    return parts[0] if len(parts) == 1 else parts


def _index(t: torch.Tensor, select) -> tuple:
    """An index for t[...] that takes the selected part: slices in every dim, at most one index list
    (a fused expert tensor's part is its expert's slice times one slice or list of rows)."""
    idx = [slice(None)] * t.dim()
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
            idx = _index(t, select)
            t[idx] = t[idx] * s
    elif kind == GAIN1P:
        t.copy_(((1.0 + t.double()) * s - 1.0).to(t.dtype))
    else:
        raise ValueError(f"unknown move kind {kind!r}")


def eps_exponent(groups: list[Group], exponents: dict[str, int]) -> int:
    """The norm eps moves by 2**(this)."""
    return sum(g.eps_power * exponents.get(g.name, 0) for g in groups)


@torch.no_grad()
def apply_exponents_(model: PreTrainedModel, family: Family, groups: list[Group], exponents: dict[str, int]) -> None:
    """Rescale `model` in place by the given group exponents (missing groups: 0)."""
    params = dict(model.named_parameters())
    for name, entries in tensor_exponents(groups, exponents).items():
        for kind, e, select in entries:
            scale_tensor_(params[name].data, kind, e, select)
    scale_eps_(model, family, eps_exponent(groups, exponents))


def scale_eps_(model: PreTrainedModel, family: Family, exponent: int) -> None:
    """Move the shared norm eps in the config and in every norm module that copied it."""
    if not exponent:
        return
    factor = 2.0 ** exponent
    # The top config, its text config, and the copies some submodules keep (T5's encoder/decoder stacks).
    configs = [model.config, model.config.get_text_config()] + [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    for config in {id(c): c for c in configs}.values():
        for attr in family.eps_attrs:
            old = getattr(config, attr, None)
            if old is None:
                continue
            setattr(config, attr, old * factor)
            for name, module in model.named_modules():
                if family.fixed_eps_modules and name.endswith(family.fixed_eps_modules):
                    continue
                for mattr in family.eps_module_attrs:
                    if isinstance(getattr(module, mattr, None), float) and getattr(module, mattr) == old:
                        setattr(module, mattr, old * factor)
