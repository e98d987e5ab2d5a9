"""Step 6, apply: the chosen (or a saved) plan written into the model's weights, in place (core/rewrite.py is the
one mutation), with the fp16 storage error of every touched tensor before and after (check.py measures it)."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..core.plan import Plan
from ..core.rewrite import apply_exponents_
from ..core.weights import value_blocks, weights_of
from .check import check_plan, storage_error


def apply_plan_(model: PreTrainedModel, plan: Plan) -> None:
    """Apply a saved plan to a model of the same architecture (in place). Refused, before any weight changes, if the
    model's names or shapes differ from the plan's, or if today's family data would move other tensors than the
    plan lists (a plan from another halfsafe version must never silently mean something else): `check_plan`."""
    family, groups = check_plan(model, plan)
    apply_exponents_(model, family, groups, plan.exponents)


def apply_measured_(model: PreTrainedModel, plan: Plan) -> list[dict]:
    """`apply_plan_`, with the fp16 storage error of every touched tensor before and after (see `storage_error`)."""
    touched = sorted({t["param"] for t in plan.tensors})
    values = weights_of(model).values()  # read as they are at each access: before, then after the plan
    before = {p: storage_error(value_blocks(values, p)) for p in touched}
    apply_plan_(model, plan)
    return [{"param": p, "before": before[p], "after": storage_error(value_blocks(values, p))} for p in touched]
