#!/usr/bin/env python
"""How much of halfsafe's remaining fp16 error on Gemma 3 270M is rounding luck: plans that are the same
function in exact arithmetic, scored on the held-out text.

Every plan keeps the residual stream at the default conversion's scale (2^-2); they differ only in where the
pair groups put the factor that the residual group gives o_proj and down_proj (v_proj/o_proj and
up_proj/down_proj are exact pairs). In float32 they agree to rounding; in float16 each rounds differently.
The spread of their KL is the resolution at which one plan can be called better than another.

Two more rows split the remaining error: the solver's plan, and the unconverted model, each run with the residual
adds in float32 (`runtime.keep_residual_fp32`: every weight and matmul still float16). Neither is an ordinary
fp16 checkpoint; they show how much of the error is the float16 residual stream itself, which no rescaling
changes (rounding is relative: 2^-11 at any scale above the subnormals).

Writes bench/results/equivalent_plans.{json,md}. Command: `python bench/fidelity/equivalent_plans.py [--seq-len 1024]`.
About 3 minutes per plan on 2 idle cores (fp16 matmuls on CPU are slow).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, git_commit  # noqa: E402

import torch  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.convert import EVAL_TOKENS, default_samples  # noqa: E402
from halfsafe.core.forward import logits as forward_logits  # noqa: E402
from halfsafe.core.forward import prefix  # noqa: E402
from halfsafe.core.groups import expand  # noqa: E402
from halfsafe.core.metrics import mean_kl, top1_agreement  # noqa: E402
from halfsafe.core.rewrite import trial  # noqa: E402
from halfsafe.engine.precision import cast_copy  # noqa: E402
from halfsafe.families import family_for  # noqa: E402
from halfsafe.io.builtin import gemma3_270m_folder  # noqa: E402
from halfsafe.io.loading import load_model  # noqa: E402
from halfsafe.runtime.baselines import keep_residual_fp32  # noqa: E402

WRITES = ("equivalent_plans.json", "equivalent_plans.md")  # in bench/results/ (python bench/list.py)

RESIDUAL = -2
# (vo exponent, up_down exponent) for every block: 0 is the solver's plan (o_proj and down_proj take 2^-2);
# -2 moves the factor onto v_proj / up_proj (o_proj / down_proj keep their stored values); +2 doubles it up.
SHIFTS = [(0, 0), (-2, 0), (0, -2), (-2, -2)]


def plan(groups, vo: int, up_down: int) -> dict[str, int]:
    e = {"residual": RESIDUAL}
    for g in groups:
        shift = {"vo": vo, "up_down": up_down}.get(g.spec, 0)
        if shift:
            e[g.name] = shift
    return e


@torch.no_grad()
def score(model, samples, refs) -> tuple[float, float, list[float]]:
    kls, tops, n = [], 0.0, 0
    for ids, ref in zip(samples, refs):
        out = forward_logits(model, ids)[0].float()
        kls.append(mean_kl(ref, out))
        tops += top1_agreement(ref, out) * ids.shape[1]
        n += ids.shape[1]
    weights = [s.shape[1] for s in samples]
    return sum(k * w for k, w in zip(kls, weights)) / n, tops / n, kls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    loaded = load_model(gemma3_270m_folder(), torch.float32)
    model, tok = loaded.model.eval(), loaded.tokenizer
    samples = make_samples([heldout_text()], tok, model.config.get_text_config().vocab_size, args.seq_len)
    refs = [forward_logits(model, s)[0].float() for s in samples]
    # what convert ranks candidates on (the first EVAL_TOKENS of the calibration text), and two whole samples
    calibration = {"prefix": [prefix(default_samples(model, tok)[0], EVAL_TOKENS)], "two_samples": default_samples(model, tok)[:2]}
    cal_refs = {k: [forward_logits(model, s)[0].float() for s in v] for k, v in calibration.items()}
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    bf16 = cast_copy(model, torch.bfloat16)
    bf_kl, bf_top, bf_each = score(bf16, samples, refs)
    del bf16
    rows = []
    for vo, ud in SHIFTS:
        t = time.perf_counter()
        with trial(model, family, groups, plan(groups, vo, ud)):
            half = cast_copy(model, torch.float16)
        kl, top, each = score(half, samples, refs)
        cal = {k: score(half, v, cal_refs[k])[0] for k, v in calibration.items()}
        del half
        rows.append({"vo": vo, "up_down": ud, "kl": kl, "top1": top, "kl_per_sample": each,
                     "kl_calibration_prefix": cal["prefix"], "kl_calibration_2x512": cal["two_samples"],
                     "below_bf16": bf_kl / kl, "seconds": time.perf_counter() - t})
        print(f"vo {vo:+d} up_down {ud:+d}: KL {kl:.3e} ({bf_kl / kl:.1f}x below bf16) {rows[-1]['seconds']:.0f}s", flush=True)
    kls = [r["kl"] for r in rows]
    for label, exps in (("solver's plan, residual adds in fp32", plan(groups, 0, 0)), ("unconverted, residual adds in fp32", {})):
        t = time.perf_counter()
        with trial(model, family, groups, exps):
            half = cast_copy(model, torch.float16)
        with keep_residual_fp32(half):
            kl, top, each = score(half, samples, refs)
        del half
        rows.append({"vo": None, "up_down": None, "label": label, "kl": kl, "top1": top, "kl_per_sample": each,
                     "below_bf16": bf_kl / kl, "seconds": time.perf_counter() - t})
        print(f"{label}: KL {kl:.3e} ({bf_kl / kl:.1f}x below bf16)", flush=True)
    data = {"command": " ".join(["python", "bench/fidelity/equivalent_plans.py", *sys.argv[1:]]), "commit": git_commit(),
            "tokens": sum(s.shape[1] for s in samples), "samples": len(samples), "residual": RESIDUAL,
            "bf16": {"kl": bf_kl, "top1": bf_top, "kl_per_sample": bf_each}, "plans": rows,
            "spread": max(kls) / min(kls)}
    (RESULTS / "equivalent_plans.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [f"Plans equivalent in exact arithmetic, Gemma 3 270M, held-out text ({data['tokens']} tokens, {len(samples)} samples "
          f"of up to {args.seq_len}), residual scale 2^{RESIDUAL}. Command: `{data['command']}`, commit {data['commit']}.", "",
          "| v/o shift | up/down shift | fp16 KL | below bf16 | top-1 | KL per sample | calibration KL: convert's prefix | 2 x 512 |",
          "|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if r["vo"] is None:
            md.append(f"| {r['label']} | | {r['kl']:.3e} | {r['below_bf16']:.1f}x | {100 * r['top1']:.2f}% | "
                      + ", ".join(f"{k:.2e}" for k in r["kl_per_sample"]) + " | | |")
            continue
        md.append(f"| {r['vo']:+d} | {r['up_down']:+d} | {r['kl']:.3e} | {r['below_bf16']:.1f}x | {100 * r['top1']:.2f}% | "
                  + ", ".join(f"{k:.2e}" for k in r["kl_per_sample"])
                  + f" | {r['kl_calibration_prefix']:.3e} | {r['kl_calibration_2x512']:.3e} |")
    md += ["", f"bf16: KL {bf_kl:.3e}, top-1 {100 * bf_top:.2f}%. Largest / smallest KL among the equivalent plans: "
           f"{data['spread']:.2f}x (equivalent plans only)."]
    (RESULTS / "equivalent_plans.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
