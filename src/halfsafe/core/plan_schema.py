"""The one check of a plan read from a file (plan.json, halfsafe.json): every field of the type halfsafe writes and
within what its solver can produce, so the code behind `Plan.from_dict` may assume a well-formed plan. Each refusal
is one line naming the field; exponents are never rounded or clamped into range."""

from __future__ import annotations

import math
from typing import NoReturn, TypeGuard

from ..errors import HalfsafeError
from ..families.spec import KINDS

MIN_EXPONENT = -24  # the solver's range for a group's exponent is [MIN_EXPONENT, 0] (see plan.solve); an inverse plan's, negated
MAX_TENSOR_EXPONENT = 4 * -MIN_EXPONENT  # a tensor sums the exponents of the few groups that move it
MAX_EPS_EXPONENT = 2 * MAX_TENSOR_EXPONENT  # eps moves by twice the residual exponent (and its scopes')
_FIX = "pass the plan.json or halfsafe.json halfsafe wrote, unedited"


def validate(d: object, newest_format: int) -> dict:
    """`d` as read from JSON, checked; returns it (with `format` filled in for plans older than the field)."""
    if not isinstance(d, dict):
        _refuse(f"the plan is {_kind(d)}, not an object")
    version = d.get("format", 1)
    if not _is_int(version) or version < 1:
        _refuse(f"its format is {version!r}, not a format number")
    if version > newest_format:
        raise HalfsafeError(f"this plan is format {version}, made by halfsafe {d.get('halfsafe_version', '?')}; this "
                            f"halfsafe reads formats up to {newest_format}: upgrade halfsafe")
    for name in ("family", "model_type"):
        if not isinstance(d.get(name), str) or not d[name]:
            _refuse(f"{name} is {_show(d.get(name))}, not a name")
    headroom = d.get("headroom_bits")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 16:
        _refuse(f"headroom_bits is {_show(headroom)}, not a number of bits from 0 to 16")
    _exponent_map(d.get("exponents"), "exponents", MIN_EXPONENT, -MIN_EXPONENT)
    _exponent_map(d.get("eps_fields", {}), "eps_fields", -MAX_EPS_EXPONENT, MAX_EPS_EXPONENT)
    _exponent(d.get("eps_exponent", 0), "eps_exponent", -MAX_EPS_EXPONENT, MAX_EPS_EXPONENT)
    context = d.get("context_length")
    if context is not None and (not _is_int(context) or context < 1):
        _refuse(f"context_length is {_show(context)}, not a number of tokens")
    if not isinstance(d.get("halfsafe_version", ""), str):
        _refuse(f"halfsafe_version is {_show(d['halfsafe_version'])}, not a version")
    tensors = d.get("tensors", [] if version == 1 else None)  # format 1 may leave the list out
    if not isinstance(tensors, list):
        _refuse(f"tensors is {_show(tensors)}, not a list of tensors")
    for i, t in enumerate(tensors):
        _tensor(t, i)
    return {**d, "format": version, "tensors": tensors}


def _tensor(t: object, i: int) -> None:
    if not isinstance(t, dict):
        _refuse(f"tensor {i} is {_kind(t)}, not an object with param, kind, exponent and part")
    if not isinstance(t.get("param"), str) or not t["param"]:
        _refuse(f"tensor {i}'s param is {_show(t.get('param'))}, not a parameter name")
    if t.get("kind") not in KINDS:
        _refuse(f"tensor {i} ({t['param']}) has kind {_show(t.get('kind'))}, not one of {', '.join(KINDS)}")
    _exponent(t.get("exponent"), f"tensor {i} ({t['param']})'s exponent", -MAX_TENSOR_EXPONENT, MAX_TENSOR_EXPONENT)
    if t.get("part") is not None and not isinstance(t["part"], str):
        _refuse(f"tensor {i} ({t['param']})'s part is {_show(t['part'])}, not a description or null")
    shape = t.get("shape")
    if shape is not None and (not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape)):
        _refuse(f"tensor {i} ({t['param']})'s shape is {_show(shape)}, not a list of sizes")


def _exponent_map(m: object, name: str, low: int, high: int) -> None:
    if not isinstance(m, dict):
        _refuse(f"{name} is {_show(m)}, not an object of exponents")
    for key, value in m.items():
        _exponent(value, f"{name}[{key!r}]", low, high)


def _exponent(value: object, name: str, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        _refuse(f"{name} is {_show(value)}; halfsafe's exponents there are integers from {low} to {high}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(type(value), "a number")


def _show(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 1e999 reads as inf
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse(why: str) -> NoReturn:
    raise HalfsafeError(f"not a halfsafe plan ({why}): {_FIX}")
