"""Step 4, plan: the constraints every group's exponent must keep (core/plan.py states and solves them), and what the
chosen plan still leaves above 65504 (refused unless --allow-unfixable) or inside the margin."""

from __future__ import annotations

from ..core.plan import FP16_MAX_BITS, Constraint, predicted_log2, site_constraints, weight_constraints
from ..core.sites import Site
from ..core.weights import weights_of
from ..errors import UnfixableOverflowError
from ..scan import ScanReport


def plan_constraints(model, groups, report: ScanReport, governed) -> tuple[list[Constraint], list[Constraint]]:
    """(every constraint: the scanned sites' under what the probe found `governed`, then the weights'; the weights'
    alone, which a second calibration keeps)."""
    weights = weight_constraints(groups, weights_of(model).values())
    return site_constraints(report.sites, governed) + weights, weights


def _problems(constraints: list[Constraint], exps: dict[str, int], headroom_bits: float):
    unfixable, tight = [], []
    for c in constraints:
        p = predicted_log2(c, exps)
        if p > FP16_MAX_BITS:
            unfixable.append((c.site, 2.0 ** p))
        elif p > FP16_MAX_BITS - headroom_bits:
            tight.append((c.site, 2.0 ** p))
    return sorted(unfixable, key=lambda x: -x[1]), sorted(tight, key=lambda x: -x[1])


def refuse_unfixable(family, finite: bool, unfixable: list[tuple[str, float]], allow_unfixable: bool) -> None:
    """Refuse a plan under which float16 still overflows (`finite`: whether the chosen candidate ran finite), unless
    `allow_unfixable`."""
    if not finite and not unfixable and not allow_unfixable:
        # every measured tensor fits, yet fp16 overflows: inside a computation no module hook sees
        raise UnfixableOverflowError(
            f"every candidate plan still gives inf/NaN in float16 although each measured activation of {family.name} "
            f"fits; the overflow is inside an op no hook sees ({family.unfixable or 'see the family notes'}). "
            "Pass --allow-unfixable to convert anyway"
        )
    if unfixable and not allow_unfixable:
        worst = ", ".join(f"{s} ({v:.3g})" for s, v in unfixable[:3])
        raise UnfixableOverflowError(
            f"{len(unfixable)} tensor(s) would still exceed 65504 and no exact rescaling of {family.name} moves them: "
            f"{worst}; {family.unfixable or 'see the family notes'}. Pass --allow-unfixable to convert anyway"
        )


def _layers_after(report: ScanReport, constraints: list[Constraint], exps: dict[str, int]) -> list[tuple[str, float]]:
    by_site = {c.site: c for c in constraints}
    out = []
    for layer in report.layers:
        c = by_site.get(str(Site(layer.name, "out")))
        out.append((layer.name, 2.0 ** predicted_log2(c, exps) if c else layer.residual_peak))
    return out
