"""Step 7, check: what the applied plan did to the weights and the output, refused before anything is written. The
fp16 storage error of a tensor (`storage_error`), the refusal of a plan that ruins one (`check_storage`), the fp32
output change, and whether a saved plan fits a model at all (`check_plan`: `halfsafe apply`, before the slow part)."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from ..core.forward import logits as forward_logits
from ..core.groups import expand
from ..core.plan import Plan, tensor_table
from ..errors import HalfsafeError
from ..families import family_for

STORAGE_LIMIT = 0.01  # relative L2 error of a tensor's fp16 copy that means it is lost; rounding alone gives ~3e-4


def storage_error(t, chunk: int = 1 << 22) -> dict:
    """How far the fp16 copy of `t` (a tensor, or its blocks of rows) is from `t`: relative L2 error, non-zero entries
    whose copy is subnormal or zero, and finite entries whose copy is inf. In chunks, one float32 buffer reused: a
    168M-entry embedding needs no full-size temporaries. x - fp16(x) is exact in float32; the sums of squares are
    torch's float32 sums (cascaded: ~1e-7 relative; `vector_norm` is 1e-4 off here). The counts look at the copy's
    exponent bits, and only where a chunk's least exponent (or its peak) says there is something to count: about
    10 ns an entry less than comparing |x|."""
    err2 = ref2 = 0.0
    subnormal = overflow = 0
    blocks = [t] if isinstance(t, torch.Tensor) else t
    buf = None
    for x in (x for b in blocks for x in b.detach().flatten().split(chunk)):
        x = x.float()
        if buf is None or buf.numel() < x.numel():
            buf = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        h, d = x.half(), buf[:x.numel()]
        err2 += float(d.copy_(h).sub_(x).square_().sum())
        ref2 += float(d.copy_(x).square_().sum())
        exponent = h.view(torch.int16) & 0x7C00  # 0: subnormal or zero; 0x7C00: inf or NaN
        if int(exponent.min()) == 0:
            subnormal += int(torch.count_nonzero(x)) - int(torch.count_nonzero(exponent))
        if int(exponent.max()) == 0x7C00:
            overflow += int(torch.count_nonzero(h.isinf() & x.isfinite()))
    return {"fp16_rel_error": math.sqrt(err2 / ref2) if ref2 > 0 else 0.0, "subnormal_or_zero": subnormal, "overflow": overflow}


def check_storage(storage: list[dict], fix: str) -> None:
    """Refuse, before anything is written, weights whose float16 copy the plan ruins: a value beyond 65504 (inf), or
    a tensor flushed (mostly) to zero, where its copy before the plan was fine."""
    for row in storage:
        before, after = row["before"], row["after"]
        if after["overflow"] > before["overflow"]:
            raise HalfsafeError(f"the plan makes {after['overflow']:,} values of {row['param']} exceed 65504, inf in float16: {fix}")
        if after["fp16_rel_error"] > max(STORAGE_LIMIT, before["fp16_rel_error"]):
            raise HalfsafeError(f"the plan flushes {row['param']} to zero in float16 ({after['fp16_rel_error']:.0%} of it lost): {fix}")


def fp32_output_change(model: PreTrainedModel, eval_ids: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative max change of the rescaled model's fp32 logits on `eval_ids` from `ref`, the original's (exact
    rescaling: ~1e-7)."""
    return float((forward_logits(model, eval_ids).float() - ref).abs().max() / ref.abs().max())


def check_plan(model: PreTrainedModel, plan: Plan):
    """Whether `plan` fits `model` (see `apply_plan_`), refused in one line if not; nothing is read but names and
    shapes, so `apply` checks this right after loading, before anything slow. Returns (family, groups)."""
    if plan.model_type != model.config.model_type:
        raise HalfsafeError(f"the plan is for model_type {plan.model_type!r}, this model is {model.config.model_type!r}")
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    unknown = set(plan.exponents) - {g.name for g in groups}
    if unknown:
        raise HalfsafeError(f"the plan names groups this model does not have: {', '.join(sorted(unknown)[:5])}")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for t in plan.tensors:
        if t["param"] not in shapes:
            raise HalfsafeError(f"the plan moves {t['param']}, which this model does not have: it was made for another architecture")
        if "shape" in t and tuple(t["shape"]) != shapes[t["param"]]:
            raise HalfsafeError(f"{t['param']} is {list(shapes[t['param']])} here but {t['shape']} in the plan: "
                                "the plan was made for a model of another size")
    keyed = lambda rows: sorted((r["param"], r["kind"], r["exponent"], r["part"]) for r in rows)  # noqa: E731
    checked = plan.tensors or plan.format >= 2  # an empty list too; only a format-1 plan may come without one
    if checked and keyed(tensor_table(groups, plan.exponents)) != keyed(plan.tensors):
        raise HalfsafeError(f"the plan's tensor list (halfsafe {plan.halfsafe_version or '0.1.0'}) differs from what today's "
                            f"{family.name} data moves for the same groups: convert the model again")
    return family, groups
