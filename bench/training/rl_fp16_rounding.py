#!/usr/bin/env python
"""Why the original Gemma 3 270M's float16 GRPO run (bench/training/rl_fp16.py, `original_fp16`) disagrees with its rollouts
20x more after the first weight push: vLLM runs that folder in bfloat16 (its config's dtype; vLLM does not run Gemma 3
in float16 unless halfsafe's plugin vouches for the folder), while the trainer computes in float16 autocast over
float32 master weights. An optimizer step moves most weights by less than a bfloat16 step, so vLLM's bfloat16 copy
keeps few of the changes that the float16 trainer computes with.

    .venv/bin/python bench/training/rl_fp16_rounding.py [--steps 3]

1. `--steps` GRPO steps of the original folder with the float16 trainer (tests/rl_case.py, in scripts/setup-vllm's
   environment: TRL's GRPOTrainer, colocated vLLM, `halfsafe.training.rl.Fp16RL`, learning rate 1e-5 as in
   bench/training/rl_fp16.py); its per-step mismatch and its trained float32 weights W.
2. Here, transformers fp32 forwards over one text: W against the untrained W0; W rounded to bfloat16 and to float16
   (each weight cast and back, computed in fp32) against W; how many of the weights the steps changed still differ
   from W0 after each rounding.

Writes bench/results/rl_fp16_rounding.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT  # noqa: E402

import rl_fp16  # noqa: E402  (the folders, the vLLM environment)

WRITES = ("rl_fp16_rounding.json", "rl_fp16_rounding.md")  # in bench/results/ (python bench/list.py)

TEXT = "3+4=7 and then 5+8=13, so the answer to 9+9= is eighteen, and 2+2=4 as well."


def train(steps: int, source: Path) -> dict:
    work = rl_fp16.WORK / "rounding"
    work.mkdir(parents=True, exist_ok=True)
    params = work / "params.safetensors"
    job = {"model": str(source), "out": str(work / "trainer"), "steps": steps, "precision": "fp16", "lr": 1e-5,
           "init_scale": 4096.0, "rescale_below_bits": None, "params": str(params)}
    env = {**rl_fp16.environment(), "MASTER_PORT": os.environ.get("MASTER_PORT", "39613")}
    done = subprocess.run([str(rl_fp16.vllm_python()), str(ROOT / "tests" / "rl_case.py"), json.dumps(job)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"the GRPO run failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["params"] = str(params)
    return out


def rounding(source: Path, params: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    ids = tok(TEXT, return_tensors="pt").input_ids
    w0 = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    w = copy.deepcopy(w0)
    w.load_state_dict(load_file(params), strict=False)

    def logps(model) -> torch.Tensor:
        with torch.no_grad():
            out = model(ids).logits.float()
        return torch.log_softmax(out, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]

    def rounded(model, dtype):
        r = copy.deepcopy(model)
        with torch.no_grad():
            for p in r.parameters():
                p.copy_(p.to(dtype).float())
        return r

    def mean_abs(a, b) -> float:
        return float((a - b).abs().mean())

    ref, ref0 = logps(w), logps(w0)
    out = {"tokens": int(ids.shape[1]), "trained_vs_untrained": mean_abs(ref, ref0), "changed": 0}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out[f"{name}_rounded_vs_trained"] = mean_abs(logps(rounded(w, dtype)), ref)
        out[f"{name}_rounded_vs_untrained"] = mean_abs(logps(rounded(w, dtype)), logps(rounded(w0, dtype)))
        out[f"changed_kept_in_{name}"] = 0
    for a, b in zip(w.parameters(), w0.parameters()):
        out["changed"] += int((a != b).sum())
        for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            out[f"changed_kept_in_{name}"] += int((a.to(dtype) != b.to(dtype)).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    source, _ = rl_fp16.folders()
    t0 = time.perf_counter()
    run = train(args.steps, source)
    figures = rounding(source, run["params"])
    steps = [{k: s.get(k) for k in ("step", "mean_abs", "k3", "max_abs", "loss_scale", "skipped")} for s in run["steps"]]
    result = {"rollout_dtype": run.get("rollout_dtype"), "trainer": "fp16 autocast, float32 master weights",
              "steps": steps, "weights": figures, "text": TEXT,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t0)}
    (RESULTS / "rl_fp16_rounding.json").write_text(json.dumps(result, indent=2) + "\n")
    f = figures
    lines = [
        "# The original's float16 GRPO run: vLLM in bfloat16, the trainer in float16 (`python bench/training/rl_fp16_rounding.py`)",
        "",
        f"vLLM computed in **{result['rollout_dtype']}**; the trainer in float16 autocast over float32 master weights; "
        "learning rate 1e-5, seed 0, tests/rl_case.py's prompts and reward.",
        "",
        "| step | mean abs mismatch | k3 | max abs |", "|---:|---:|---:|---:|",
        *[f"| {s['step']} | {s['mean_abs']:.3g} | {s['k3']:.3g} | {s['max_abs']:.3g} |" for s in steps],
        "",
        f"After {len(steps)} steps, transformers fp32 on one text ({f['tokens']} tokens), mean |difference| of the "
        "tokens' log-probabilities:",
        "",
        "| | mean abs |", "|---|---:|",
        f"| trained W against untrained W0 | {f['trained_vs_untrained']:.3g} |",
        f"| W rounded to bfloat16 (what vLLM computes with) against W | {f['bfloat16_rounded_vs_trained']:.3g} |",
        f"| W rounded to float16 (what the trainer's autocast computes with) against W | {f['float16_rounded_vs_trained']:.3g} |",
        "",
        f"Of the {f['changed']:,} weights the steps changed, {f['changed_kept_in_bfloat16']:,} "
        f"({f['changed_kept_in_bfloat16'] / f['changed']:.0%}) still differ from W0 once rounded to bfloat16 and "
        f"{f['changed_kept_in_float16']:,} ({f['changed_kept_in_float16'] / f['changed']:.0%}) once rounded to float16.",
        "",
        f"{result['machine']}, {result['date']}.",
    ]
    (RESULTS / "rl_fp16_rounding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
