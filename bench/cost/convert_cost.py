"""Convert's CPU time against one forward of its own calibration set, side by side on one machine: the goal is convert
at most 1.3x that forward (issue 34) and at most 100 CPU-s per billion parameters.

    python bench/cost/convert_cost.py [--size 0.3b|1.2b|qwen7b|...] [--checkpoint DIR] [--threads N] [--calib-arith auto]

Two fresh processes, one after the other, each with OMP_NUM_THREADS=N (default 1: on a shared machine OpenMP threads
spin while they wait for a core, which inflates CPU-seconds):
  1. `halfsafe convert SYN OUT --device cpu --overwrite --json J [--calib-arith A]` (CPU-s: user + system of the
     process, from getrusage); its phases from J, the arithmetic it calibrated in from OUT/halfsafe.json;
  2. the forward alone: the same checkpoint loaded the same way (streamed), the same samples (the CLI's defaults),
     run in step under the same arithmetic with no hooks (`core.forward.run_for_stats`, as the scan runs it): CPU-s of
     the forward only (`time.process_time`, every thread), and of the whole process.
Beside them the CPU's matrix product speed per dtype (bench/cost/scale_7b.py's `gemm_speeds`) and its flags, so figures
from different CPUs read side by side. Writes bench/results/convert_cost-SIZE[-bfloat16].{json,md} (`result_stem`; --results DIR elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, git_commit  # noqa: E402

from make_synthetic import QWEN_SIZES, SIZES, write_checkpoint  # noqa: E402
from scale_7b import checkpoint_params, default_checkpoint, gemm_speeds, gemm_text, machine  # noqa: E402

WRITES = ("convert_cost-*.json", "convert_cost-*.md")  # in bench/results/ (python bench/list.py)

GOAL_RATIO = 1.3
GOAL_PER_BILLION = 100.0


def forward_only(folder: str, calib_arith: str) -> dict:
    """In this process: load as convert loads, cut the samples as convert does, time one forward of all of them."""
    from functools import partial

    import torch

    from halfsafe.core.forward import run_for_stats
    from halfsafe.engine.calib_arith import calib_arith as arith
    from halfsafe.engine.pipeline import in_step
    from halfsafe.engine.shared_head import SharedHead
    from halfsafe.io.loading import load_model
    from halfsafe.job import calibration
    from halfsafe.requests.convert import CONVERT_TEXT

    loaded = load_model(folder, stream=True, device="cpu")
    job, _ = calibration(loaded, None, CONVERT_TEXT.seq_len, CONVERT_TEXT.max_samples)
    model = loaded.model
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    with torch.no_grad(), arith(calib_arith):
        shared = SharedHead.of(model, job.samples)  # a wide head read once for every sample, as the scan reads it
        in_step(model, [partial(run_for_stats, model, ids, shared) for ids in job.samples])
        if shared is not None:
            shared.run()
    return {"forward_cpu_s": time.process_time() - start_cpu, "forward_wall_s": time.perf_counter() - start_wall,
            "samples": len(job.samples), "tokens": sum(int(s.numel()) for s in job.samples)}


MATRIX_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def matrix_flags() -> list[str]:
    """Which of the instruction sets that decide bfloat16/float16 product speed this CPU has (/proc/cpuinfo)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [f for f in MATRIX_FLAGS if f in flags]


def timed(argv: list[str], env: dict) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[:4])} ...: exit {done.returncode}\n{done.stderr[-2000:]}")
    return {"cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "wall_s": wall,
            "peak_rss_gb": after.ru_maxrss / 1e6, "stdout": done.stdout}


def run(args: argparse.Namespace) -> dict:
    syn = Path(args.checkpoint) if args.checkpoint else default_checkpoint(args.size)
    if not (syn / "config.json").exists():
        write_checkpoint(syn, args.size, "5GB" if args.size in QWEN_SIZES else "1GB")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out, report = work / f"{syn.name}-fp16", work / f"{syn.name}.convert.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    import torch

    torch.set_num_threads(args.threads)
    gemm = gemm_speeds()
    halfsafe = [sys.executable, "-m", "halfsafe.cli"]
    convert = timed([*halfsafe, "convert", str(syn), str(out), "--device", "cpu", "--overwrite", "--json", str(report),
                     "--calib-arith", args.calib_arith], env)
    phases = json.loads(report.read_text())["phases"]
    used = json.loads((out / "halfsafe.json").read_text())["calib_arith"]
    shutil.rmtree(out, ignore_errors=True)
    fwd = timed([sys.executable, __file__, "--forward-only", str(syn), "--calib-arith", used["used"]], env)
    forward = json.loads(fwd["stdout"].strip().splitlines()[-1])
    params = checkpoint_params(syn)
    ratio = convert["cpu_s"] / forward["forward_cpu_s"]
    return {
        "size": args.size, "checkpoint": str(syn), "parameters": params, "threads": args.threads,
        "machine": {**machine(), "matrix_flags": matrix_flags()}, "gemm_gflops": gemm, "calib_arith": used,
        "convert": {k: v for k, v in convert.items() if k != "stdout"}, "phases": phases,
        "forward": {**forward, "process_cpu_s": fwd["cpu_s"], "process_wall_s": fwd["wall_s"]},
        "convert_over_forward": ratio, "convert_cpu_s_per_billion": convert["cpu_s"] / params * 1e9,
        "forward_cpu_s_per_billion": forward["forward_cpu_s"] / params * 1e9,
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def markdown(r: dict) -> str:
    c, f = r["convert"], r["forward"]
    rest = c["cpu_s"] - sum(p["cpu_s"] for p in r["phases"])
    lines = [
        f"# convert's CPU time against one forward of its calibration set: {r['size']} synthetic",
        "",
        f"{r['parameters'] / 1e9:.2f}B parameters, {f['samples']} samples, {f['tokens']} tokens; "
        f"{r['threads']} thread(s); commit {r['commit']}, {r['date']}.",
        f"CPU: {r['machine'].get('cpu', '?')} ({', '.join(r['machine']['matrix_flags']) or 'no flags read'}); {gemm_text(r['gemm_gflops'])} "
        f"Calibration arithmetic: {r['calib_arith']['used']} ({r['calib_arith']['why']}).",
        "",
        "| | CPU-s | per billion parameters | wall s |",
        "|---|---:|---:|---:|",
        f"| one forward of the calibration set (in step, no hooks) | {f['forward_cpu_s']:.1f} | "
        f"{r['forward_cpu_s_per_billion']:.0f} | {f['forward_wall_s']:.1f} |",
        f"| that process, with imports and load | {f['process_cpu_s']:.1f} | | {f['process_wall_s']:.1f} |",
        f"| `halfsafe convert` | {c['cpu_s']:.1f} | {r['convert_cpu_s_per_billion']:.0f} | {c['wall_s']:.1f} |",
        "",
        f"convert / forward: **{r['convert_over_forward']:.2f}x** (goal <= {GOAL_RATIO}x); convert per billion: "
        f"**{r['convert_cpu_s_per_billion']:.0f} CPU-s** (goal <= {GOAL_PER_BILLION:.0f}). Peak RSS of convert: "
        f"{c['peak_rss_gb']:.2f} GB.",
        "",
        "convert's phases (CPU-s): " + ", ".join(f"{p['name']} {p['cpu_s']:.1f}" for p in r["phases"])
        + f"; outside them (imports, tokenizer, the report) {rest:.1f}.",
        "",
    ]
    return "\n".join(lines)


def result_stem(size: str, used: str) -> str:
    """convert_cost-SIZE for a float32 calibration, convert_cost-SIZE-bfloat16 for a bfloat16 one: a CPU that
    calibrates in bfloat16 (AVX512-BF16, AMX) keeps its figures beside a float32 CPU's."""
    return f"convert_cost-{size}" + ("" if used == "float32" else f"-{used}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.3b", choices=sorted(QWEN_SIZES) + sorted(SIZES))
    ap.add_argument("--checkpoint", help="the synthetic's folder (written there when it has no config.json)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calib-arith", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--work", default="/tmp/halfsafe-synthetic")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--forward-only", metavar="FOLDER", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.forward_only:
        print(json.dumps(forward_only(args.forward_only, args.calib_arith)))
        return 0
    r = run(args)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.size, r["calib_arith"]["used"])
    (results / f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    text = markdown(r)
    (results / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
