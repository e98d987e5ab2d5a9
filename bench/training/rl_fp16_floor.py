#!/usr/bin/env python
"""Where the rollout/trainer mismatch of bench/training/rl_fp16.py comes from: each engine against float32 on the same tokens.

    .venv/bin/python bench/training/rl_fp16_floor.py [--prompts 16] [--samples 4] [--completion 16]

For halfsafe's folder in float16 and the original in bfloat16 (the real Gemma 3 270M, before any training step),
real vLLM samples completions at temperature 1 (bench/training/rl_fp16.py's prompts) and returns each sampled token's
log-probability; on the same tokens, transformers computes it in float32 (the reference) and as the GRPO trainer
does (autocast to the dtype, products from float32 kernels rounded once: halfsafe.training.rl's arithmetic). Each
pair's mean |difference| and k3 (halfsafe.training.mismatch) says which side the mismatch comes from: where both
engines round at their dtype's precision, float16's 3 more mantissa bits make each rounding 8x smaller, so the
mean |difference| shrinks by about 8x and k3, quadratic in it, by about 64x.

Writes bench/results/rl_fp16_floor.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
import common  # noqa: E402,F401  (bench/'s folders on sys.path)

import rl_fp16  # noqa: E402  (the prompts, the folders, the vLLM environment)

WRITES = ("rl_fp16_floor.json",)  # in bench/results/ (python bench/list.py)

CASES = {"halfsafe_fp16": ("converted", "float16"), "original_bf16": ("original", "bfloat16")}


def measure(job: dict) -> dict:
    """In the vLLM environment: vLLM's sampled tokens and log-probabilities, then transformers' on the same tokens."""
    os.environ.update(rl_fp16.VLLM_ENV)
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from halfsafe.engine.fp16_arith import EMULATED, fp16_arith
    from halfsafe.training.mismatch import rollout_mismatch

    dtype = getattr(torch, job["dtype"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    prompts = [tok(p["prompt"])["input_ids"] for p in rl_fp16.prompts()[: job["prompts"]]]
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=256, enforce_eager=True, seed=rl_fp16.SEED,
              kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(n=job["samples"], temperature=1.0, max_tokens=job["completion"], logprobs=0, seed=rl_fp16.SEED)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rollouts = []  # (prompt ids, completion ids, vLLM's log-probabilities)
    for p, g in zip(prompts, got):
        for c in g.outputs:
            lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
            rollouts.append((p, list(c.token_ids), lps))
    del llm
    gc.collect()

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()

    def logprobs(autocast: bool) -> list[torch.Tensor]:
        out = []
        for p, c, _ in rollouts:
            ids = torch.tensor([p + c])
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=autocast), \
                    fp16_arith(EMULATED if autocast else "native", dtype):
                logits = model(ids).logits[0, len(p) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
        return out

    fp32, trainer = logprobs(False), logprobs(True)
    vllm = [torch.tensor(lp, dtype=torch.float64) for _, _, lp in rollouts]
    cat = torch.cat
    return {"tokens": sum(len(c) for _, c, _ in rollouts),
            "vllm_vs_fp32": rollout_mismatch(cat(fp32), cat(vllm)),
            "trainer_vs_fp32": rollout_mismatch(cat(fp32), cat(trainer)),
            "vllm_vs_trainer": rollout_mismatch(cat(trainer), cat(vllm))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--completion", type=int, default=16)
    ap.add_argument("--out", default=str(rl_fp16.RESULTS / "rl_fp16_floor.json"))
    args = ap.parse_args()
    rl_fp16.WORK.mkdir(parents=True, exist_ok=True)
    python, env = rl_fp16.vllm_python(), rl_fp16.environment()
    source, converted = rl_fp16.folders()
    results = {}
    for name, (kind, dtype) in CASES.items():
        job = {"model": str(converted if kind == "converted" else source), "dtype": dtype, "prompts": args.prompts,
               "samples": args.samples, "completion": args.completion}
        results[name] = rl_fp16.in_vllm(python, env, "--floor", job, script=__file__)
        print(name, json.dumps(results[name])[:400], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    lines = ["| run | pair | mean abs | k3 | max abs |", "|---|---|---:|---:|---:|"]
    for name, r in results.items():
        for pair in ("vllm_vs_fp32", "trainer_vs_fp32", "vllm_vs_trainer"):
            m = r.get(pair) or {}
            lines.append(f"| {name} | {pair.replace('_vs_', ' vs ')} | {m.get('mean_abs', float('nan')):.2e} | "
                         f"{m.get('k3', float('nan')):.2e} | {m.get('max_abs', float('nan')):.2e} |")
    a, b = results.get("halfsafe_fp16", {}), results.get("original_bf16", {})
    for pair in ("vllm_vs_fp32", "vllm_vs_trainer"):
        if pair in a and pair in b:
            lines.append(f"\n{pair}: bf16 / fp16 = {b[pair]['mean_abs'] / a[pair]['mean_abs']:.1f}x mean abs, "
                         f"{b[pair]['k3'] / a[pair]['k3']:.1f}x k3")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--floor":
        result = measure(json.loads(sys.argv[2]))
        sys.stdout.flush()
        print(json.dumps(result, allow_nan=True))
    else:
        main()
