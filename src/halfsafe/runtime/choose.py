"""`convert --runtime P`: choose the plan under a runtime profile's float16 arithmetic, or refuse in one line.

The profile adds constraints the torch path does not have (halfsafe.runtime.stats measures them on the float32 run):
a norm's sum of squares must stay under 65504 (it scales by s^2 with the residual scale s where the norm reads the
residual), a linear layer's running partial sums too (they scale as its output). The residual scales that meet them
join the usual candidates; every candidate runs in float16 *under the profile* (halfsafe.runtime.emulate) on the evaluation
prefix, and the least-KL one among those that are finite, not collapsed and at least as close to float32 as bfloat16
on the same tokens is chosen. If none is, the checkpoint format cannot hold what the profile needs, and the refusal
says which sites, the scale they need, and what breaks there: the norm eps moved by s^2 that rounds to 0 in float16,
a stored weight that overflows (a tied head's final-norm gain), or gains too coarse in float16 (KL measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..core import arith16
from ..core.collapse import collapsed
from ..core.formats import all_finite
from ..core.forward import logits as forward_logits
from ..core.metrics import mean_kl, top1_agreement
from ..core.plan import FP16_MAX_BITS, Constraint, predicted_log2, solve
from ..core.rewrite import eps_exponent, trial
from ..core.sites import Site
from ..engine.precision import in_dtype
from ..errors import HalfsafeError
from .emulate import emulate_runtime, is_rms_norm
from .profiles import RuntimeProfile
from .stats import RuntimeScan, _eps


@dataclass
class ProfiledCandidate:
    exponents: dict[str, int]
    kl: float  # under the profile, on the evaluation prefix
    top1: float
    finite: bool
    collapsed: bool
    eps: float | None  # the norm eps after the plan (None: the family moves none)
    overflowing_weights: list[str]

    @property
    def residual_exponent(self) -> int:
        return self.exponents.get("residual", 0)

    def acceptable(self, bf16_kl: float) -> bool:
        return self.finite and not self.collapsed and not self.overflowing_weights and self.kl <= bf16_kl

    def to_dict(self) -> dict:
        return {"exponents": self.exponents, "kl": self.kl, "top1": self.top1, "finite": self.finite,
                "collapsed": self.collapsed, "eps": self.eps, "overflowing_weights": self.overflowing_weights}


def runtime_constraints(constraints, rt: RuntimeScan, headroom_bits: float) -> tuple[list[Constraint], list[str]]:
    """The profile's quantities as solver constraints: a norm's sum of squares moves by twice the powers of the
    norm's input (s^2), a linear layer's partial sums as its output. Also the sites that pass the margin and that no
    group moves (nothing in a checkpoint can bring them down)."""
    by_site = {c.site: c for c in constraints}
    limit = FP16_MAX_BITS - headroom_bits
    out, stuck = [], []
    quantities = [(str(Site(n, "in")), "sum of squares", s.sum_sq_max, 2) for n, s in rt.norms.items()]
    quantities += [(str(Site(n, "out")), "partial sums", s.partial_max, 1) for n, s in rt.linears.items()]
    for site, what, value, power in quantities:
        if value <= 0:
            continue
        powers = {g: p * power for g, p in (by_site[site].powers if site in by_site else {}).items()}
        out.append(Constraint(f"{site} ({what})", math.log2(value), powers))
        if not powers and math.log2(value) > limit:
            stuck.append(f"{site} ({what} {value:.3g})")
    return out, stuck


@torch.no_grad()
def evaluate(model, family, groups, constraints, exps, ids, ref, profile: RuntimeProfile, base_eps: float | None) -> ProfiledCandidate:
    """Apply the plan, run in float16 under the profile's arithmetic, compare with the float32 reference, undo."""
    with trial(model, family, groups, exps), in_dtype(model, torch.float16) as half, emulate_runtime(half, profile):
        out = forward_logits(half, ids)
    finite = all_finite(out)
    weights = [c.site[len("weight:"):] for c in constraints
               if c.site.startswith("weight:") and predicted_log2(c, exps) > FP16_MAX_BITS]
    eps = None if base_eps is None else base_eps * 2.0 ** eps_exponent(groups, exps)  # the first norm's, as stored
    return ProfiledCandidate(dict(exps), mean_kl(ref, out) if finite else math.inf, top1_agreement(ref, out), finite,
                             collapsed(ref, out), eps, weights)


@torch.no_grad()
def bf16_kl(model, ids, ref) -> float:
    with in_dtype(model, torch.bfloat16) as b:
        return mean_kl(ref, forward_logits(b, ids))


def candidate_plans(groups, constraints, headroom_bits, usual: list[dict]) -> list[dict]:
    """The usual candidates, the solver's plan under the profile's constraints too, and one residual step below it."""
    out = [dict(e) for e in usual]
    best = solve(groups, constraints, headroom_bits)
    extra = [best]
    if "residual" in best:
        extra.append(solve(groups, constraints, headroom_bits, fixed={"residual": best["residual"] - 1}))
    for e in extra:
        if e not in out:
            out.append(e)
    return sorted(out, key=lambda e: -e.get("residual", 0))


def needing(extra: list[Constraint], exps: dict, headroom_bits: float) -> list[tuple[str, float]]:
    """The profile quantities a plan leaves above the margin: (site, predicted value)."""
    limit = FP16_MAX_BITS - headroom_bits
    return sorted([(c.site, 2.0 ** predicted_log2(c, exps)) for c in extra if predicted_log2(c, exps) > limit],
                  key=lambda x: -x[1])


def choose(model, family, groups, constraints, headroom_bits, usual, ids, ref, rt: RuntimeScan) -> tuple[dict, dict]:
    """(chosen exponents, what was measured) under `rt.profile`; HalfsafeError when the format cannot hold it."""
    profile = rt.profile
    extra, stuck = runtime_constraints(constraints, rt, headroom_bits)
    base_eps = next((_eps(m) for m in model.modules() if is_rms_norm(m) or isinstance(m, nn.LayerNorm)), None)
    plans = candidate_plans(groups, constraints + extra, headroom_bits, usual)
    tried = [evaluate(model, family, groups, constraints, e, ids, ref, profile, base_eps) for e in plans]
    bf16 = bf16_kl(model, ids, ref)
    target = solve(groups, constraints + extra, headroom_bits)
    info = {"profile": profile.to_dict(), "bf16_kl": bf16, "profile_plan": target,
            "still_above_margin": [{"site": s, "value": v} for s, v in needing(extra, target, headroom_bits)[:20]],
            "unmovable_sites": stuck[:20], "candidates": [c.to_dict() for c in tried]}
    ok = [c for c in tried if c.acceptable(bf16)]
    if ok and not stuck:
        best = min(ok, key=lambda c: c.kl)
        info["chosen"] = best.exponents
        return best.exponents, info
    at = next(c for c in tried if c.exponents == target)
    raise HalfsafeError(refusal(profile, target, needing(extra, {}, headroom_bits), stuck, at, tried, bf16))


def refusal(profile, target: dict, over: list, stuck: list, at: ProfiledCandidate, tried, bf16: float) -> str:
    """One line: the sites, the scale they need, and why the checkpoint format cannot hold it (`at`: the candidate
    that meets the profile's constraints; `over`: the profile's quantities above the margin before any rescale)."""
    head = f"no fp16 checkpoint runs under --runtime {profile.name}"
    if stuck:
        return f"{head}: {len(stuck)} site(s) pass 65504 there and no exact rescaling moves them (e.g. {stuck[0]})"
    need = target.get("residual", 0)
    sites = (f"{len(over)} site(s) (e.g. {over[0][0]} at {over[0][1]:.3g}) need the residual at 2^{need}" if over
             else "every candidate breaks")
    why = []
    if at.eps is not None and at.eps > 0 and arith16.scalar16(at.eps) == 0.0:
        why.append(f"the norm eps moved to {at.eps:.2g} rounds to 0 in float16")
    if at.overflowing_weights:
        why.append(f"{at.overflowing_weights[0]} would overflow float16 as stored")
    if not at.finite:
        why.append("the float16 run is non-finite")
    elif at.collapsed:
        why.append("the outputs collapse (near-uniform)")
    elif at.kl > bf16:
        why.append(f"the rescaled weights stored in float16 are too coarse (KL {at.kl:.2g} under the profile vs bf16 {bf16:.2g})")
    best = min(tried, key=lambda c: c.kl)
    return (f"{head}: {sites}, where {'; '.join(why) or 'it does not run'}; the best candidate (residual 2^"
            f"{best.residual_exponent}) gives KL {best.kl:.2g} against bf16's {bf16:.2g}. A graph format can prescale "
            "inside each norm instead; convert without --runtime for PyTorch-arithmetic runtimes")
