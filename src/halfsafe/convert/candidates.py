"""Step 5, candidates: the plans worth trying around the solver's, each run in float16 against the fp32 reference
on the evaluation prefix, and the one chosen (`choose_candidate`: the least fp16 KL among those that keep the margin).
Under a runtime profile other than torch, halfsafe.runtime.choose measures them instead (`_choose_under`)."""

from __future__ import annotations

import math

import torch

from ..core.formats import all_finite
from ..core.forward import logits as forward_logits
from ..core.forward import prefix
from ..core.metrics import mean_kl, top1_agreement
from ..core.plan import FP16_MAX_BITS, MIN_EXPONENT, Constraint, predicted_log2, solve
from ..core.rewrite import model_key, trial
from ..engine.calib_arith import float32_products
from ..engine.precision import in_dtype
from ..progress import phase
from ..requests import Fp16Options, ScanOptions
from ..runtime.choose import choose
from ..scan import scan_with
from .report import Candidate

EVAL_TOKENS = 128  # fp16 forward passes on CPU are slow; candidates are ranked on this prefix
CANDIDATES_ABOVE = 2  # residual scales tried above the largest one that keeps the margin (see keeps_margin)


def try_candidates(profile, model, family, groups, constraints, headroom_bits, n, eval_ids, ref, report, samples, progress,
                   arith: str) -> tuple[Candidate, list[Candidate], dict | None]:
    """The step: (the chosen candidate, every one tried, what halfsafe.runtime.choose measured under `profile` or
    None). Each keeps the margin of the solver's plan (`reference`) or is not run (`keeps_margin`)."""
    reference = solve(groups, constraints, headroom_bits)
    if profile.is_torch:
        tried = _evaluate_all(model, family, groups, constraints, reference, headroom_bits, n, eval_ids, ref, progress, arith)
        return choose_candidate(tried), tried, None
    return _choose_under(profile, model, family, groups, constraints, reference, headroom_bits, n, eval_ids, ref, report,
                         samples, progress)


def reference_logits(model, eval_ids: torch.Tensor) -> torch.Tensor:
    """The model as it is, in float32: what every candidate is compared with."""
    with float32_products():  # beside a bfloat16 calibration too: its products stay float32
        return forward_logits(model, eval_ids).float()


@torch.no_grad()
def evaluate_candidate(model, family, groups, exponents, ids, ref, arith: str = "native") -> Candidate:
    """Apply, run in fp16 on `ids` (`arith`: halfsafe.engine.fp16_arith), compare to the fp32 reference, undo (bit for bit)."""
    with trial(model, family, groups, exponents), in_dtype(model, torch.float16, arith) as half:
        out = forward_logits(half, ids)  # compared in fp16: the metrics widen a few positions at a time, exactly
    finite = all_finite(out)
    return Candidate(dict(exponents), mean_kl(ref, out) if finite else math.inf, top1_agreement(ref, out), finite)


def candidate_exponents(groups, constraints, headroom_bits, n: int, above: int = CANDIDATES_ABOVE) -> list[dict[str, int]]:
    """The plan with the largest exponents that keep the margin (`headroom_bits`), the residual scale up to
    `above` steps larger and n-1 steps smaller (other groups solved again for each): larger scales keep
    Gemma's (1+w) gains finer in fp16, smaller ones add headroom. `keeps_margin` says which may be chosen;
    the measured fp16 KL decides among those."""
    best = solve(groups, constraints, headroom_bits)
    out = [best]
    if "residual" in best:
        for d in [*range(above, 0, -1), *range(-1, -n, -1)]:
            r = best["residual"] + d
            if not MIN_EXPONENT <= r <= 0:
                continue  # never scale up, nor below what a plan may hold
            cand = solve(groups, constraints, headroom_bits, fixed={"residual": r})
            if cand not in out:
                out.append(cand)
    return sorted(out, key=lambda e: -e.get("residual", 0))


def keeps_margin(constraints: list[Constraint], exps: dict[str, int], reference: dict[str, int], headroom_bits: float) -> tuple[bool, float]:
    """The margin rule: a candidate keeps the margin when every movable peak that the solver's plan
    (`reference`, solved for `headroom_bits`) keeps `headroom_bits` under 65504 stays there too, and no
    peak the solver could not bring there gets larger. Returns (kept, bits left on the tightest such peak)."""
    limit = FP16_MAX_BITS - headroom_bits
    kept, left = True, math.inf
    for c in constraints:
        if not c.powers:
            continue  # nothing moves it: reported as unfixable or tight, the same for every candidate
        p, ref = predicted_log2(c, exps), predicted_log2(c, reference)
        if ref <= limit + 1e-9:
            kept &= p <= limit + 1e-9
            left = min(left, FP16_MAX_BITS - p)
        else:
            kept &= p <= ref + 1e-9
    return kept, left


def choose_candidate(tried: list[Candidate]) -> Candidate:
    """The least fp16 KL among candidates that keep the margin and ran finite (ties: more headroom)."""
    valid = [c for c in tried if c.keeps_margin and c.finite] or [c for c in tried if c.keeps_margin] or tried
    return min(valid, key=lambda c: (c.kl, -c.headroom_bits))


def _evaluate_all(model, family, groups, constraints, reference, headroom_bits, n, eval_ids, ref,
                  progress: bool = False, arith: str = "native") -> list[Candidate]:
    """Every candidate of `candidate_exponents`, those that keep the margin run in fp16; one whose exponents make the
    same model as one already run (`model_key`) takes that one's measurement instead of running again."""
    tried, measured = [], {}
    for e in candidate_exponents(groups, constraints, headroom_bits, n):
        kept, left = keeps_margin(constraints, e, reference, headroom_bits)
        if not kept:
            c = Candidate(dict(e), math.nan, math.nan, False)
        else:
            key = model_key(groups, e)
            if key not in measured:
                name = f"candidate residual 2^{e['residual']}" if "residual" in e else "candidate"
                with phase(name, model, quiet=not progress):  # an fp16 copy made inside is counted too
                    measured[key] = evaluate_candidate(model, family, groups, e, eval_ids, ref, arith)
            m = measured[key]
            c = Candidate(dict(e), m.kl, m.top1, m.finite)
        c.headroom_bits, c.keeps_margin = left, kept
        tried.append(c)
    return tried


def _choose_under(profile, model, family, groups, constraints, reference, headroom_bits, n, eval_ids, ref, report, samples,
                  progress):
    """convert --runtime: the candidates measured under the profile (halfsafe.runtime.choose), as Candidates."""
    rt = report.runtime if report.runtime is not None and report.runtime.profile == profile else \
        scan_with(model, samples, ScanOptions(fp16=Fp16Options(profile)), progress).runtime
    usual = candidate_exponents(groups, constraints, headroom_bits, n)
    exps, info = choose(model, family, groups, constraints, headroom_bits, usual, eval_ids, ref, rt)
    tried = []
    for c in info["candidates"]:
        kept, left = keeps_margin(constraints, c["exponents"], reference, headroom_bits)
        tried.append(Candidate(dict(c["exponents"]), c["kl"], c["top1"], c["finite"], left, kept))
    return next(c for c in tried if c.exponents == exps), tried, info


def _eval_ids(samples: list[torch.Tensor]) -> torch.Tensor:
    return prefix(samples[0], EVAL_TOKENS)
