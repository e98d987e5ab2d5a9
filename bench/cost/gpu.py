"""Speed and memory on a CUDA GPU: bf16, fp16 original, fp16 + fp32 residual, and halfsafe fp16, plus the time
`halfsafe convert` takes on the GPU.

    python bench/cost/gpu.py [MODEL] [--out bench/results/gpu.md] [--batch 8] [--seq-len 512] [--new-tokens 64]

MODEL defaults to the Gemma 3 270M fixture. Per variant: forward tokens/s on a batch of the embedded text, greedy
generation tokens/s, peak GPU memory, and whether the logits are finite. Needs a CUDA build of torch and a GPU;
on a machine without one it says so and exits 1. `--device cpu` runs the same steps on the CPU (no memory
figure): the test suite does that on a tiny model, so the script is known to run before a GPU is at hand.

    python bench/cost/gpu.py --scale qwen7b [--time-limit 540] [--results DIR] [--work DIR]

`--scale SIZE`: the 7B bench (bench/cost/scale_7b.py) on one GPU: write the bench/tools/make_synthetic.py checkpoint (or take
--checkpoint), then `halfsafe convert SYN OUT --device cuda` (calibration: --samples, --calib-seq-len) and `halfsafe
verify SYN OUT --device cuda --seq-len 512 --max-samples 1 --json ...` (--seq-len, --verify-samples), all within
--time-limit seconds (a command past it is killed, exit 124, and the
result says so). Records wall and CPU seconds per command, the reports' "phases" and "checkpoint_reads" where
present, and verify's KL per variant; writes RESULTS/gpu_scale_SIZE.json (after every step, so a killed run keeps
what it measured). Disk: 2 bytes a parameter for the synthetic and as much for the output (~31 GB at 7B). With
`--device cpu` and a tiny size (`--scale qwen7b-tiny --samples 1 --calib-seq-len 32 --seq-len 32 --greedy-tokens 2`) it is a dry run of the same steps on a CPU-only machine.

    python bench/cost/gpu.py --vllm PY [--out bench/results/gpu_vllm.md]

`--vllm PY`: the real Gemma 3 270M served by vLLM on the GPU (PY: a Python with a CUDA build of vLLM and halfsafe
installed, e.g. a venv made with `pip install vllm` then `pip install -e .`): bench/runtimes/vllm_cpu.py's rows, the converted
folder in float16 (halfsafe's plugin), the original in bfloat16 (refused on GPUs without it: the row says so) and
float32; top-1, logprob and KL against transformers fp32, tokens per second.

RL in fp16 on the GPU (GRPO, TRL with colocated vLLM; real AMP there, vLLM's CUDA kernels): `python bench/training/rl_fp16.py
--vllm-python PY --out bench/results/rl_fp16_gpu.json`, PY a Python with CUDA builds of torch and vLLM, trl==1.16.0
and halfsafe installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
import common  # noqa: E402,F401  (puts bench/'s folders on sys.path: scale_7b, make_synthetic, vllm_cpu)

import torch

from halfsafe.calibration import default_text, make_samples
from halfsafe.convert import convert_checkpoint
from halfsafe.io.loading import load_model
from halfsafe.runtime.baselines import keep_residual_fp32

WRITES = ("gpu.md", "gpu_vllm.md", "gpu_scale_*.json")  # in bench/results/ (python bench/list.py)
ON_DEMAND = {"gpu.md": "on a CUDA GPU (not run on one yet)", "gpu_vllm.md": "--vllm PY, on a CUDA GPU (not run on one yet)", "gpu_scale_*.json": "--scale SIZE, on a CUDA GPU (not run on one yet)"}  # not in bench/results/ until run so


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeat: int = 3) -> float:
    fn()  # warm-up (kernels, allocator)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeat


@torch.no_grad()
def measure(name: str, model, ids: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = model.to(device).eval()
    ids = ids.to(device)
    logits = model(input_ids=ids, use_cache=False).logits
    fwd = _timed(lambda: model(input_ids=ids, use_cache=False), device)
    gen_ids = ids[:1, :32]
    gen = _timed(lambda: model.generate(gen_ids, attention_mask=torch.ones_like(gen_ids), max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens, do_sample=False), device, 1)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {"variant": name, "finite": bool(torch.isfinite(logits).all()), "forward_tok_s": ids.numel() / fwd,
            "generate_tok_s": new_tokens / gen, "peak_gb": peak}


def scale_main(args: argparse.Namespace) -> int:
    """Convert and verify a synthetic (or --checkpoint) with the CLI on args.device, within args.time_limit seconds."""
    import scale_7b
    from make_synthetic import QWEN_SIZES, SIZES, write_checkpoint

    deadline = time.time() + args.time_limit
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    syn = Path(args.checkpoint) if args.checkpoint else work / args.scale
    out, verify_json, logs = work / f"{syn.name}-fp16", work / f"{syn.name}.verify.json", work / "logs"
    logs.mkdir(exist_ok=True)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"gpu_scale_{args.scale}.json"
    device = torch.device(args.device)
    result = {"command": " ".join(["python", "bench/cost/gpu.py", *sys.argv[1:]]), "git_commit": scale_7b.git_commit(),
              "machine": {**scale_7b.machine(), **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
              "measurement": device.type == "cuda", "size": args.scale, "checkpoint": str(syn), "time_limit_s": args.time_limit,
              "steps": {}}

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    if not (syn / "config.json").is_file():
        if args.scale not in {**SIZES, **QWEN_SIZES}:
            print(f"--scale {args.scale}: not a bench/tools/make_synthetic.py size ({', '.join([*QWEN_SIZES, *SIZES])}); "
                  "or pass --checkpoint", file=sys.stderr)
            return 2
        start = time.time()
        write_checkpoint(syn, args.scale, "5GB" if args.scale in QWEN_SIZES else "1GB")
        result["steps"]["generate"] = {"exit": 0, "wall_s": round(time.time() - start, 1)}
    result["params"] = scale_7b.checkpoint_params(syn)
    save()
    cmds = scale_7b.commands(syn, out, verify_json, args.device, args.samples, args.calib_seq_len, args.verify_samples,
                             args.seq_len, args.greedy_tokens)
    for name, argv in cmds.items():
        left = int(deadline - time.time())
        if left < 10:
            result["steps"][name] = {"exit": None, "skipped": "no time left"}
            save()
            break
        step = scale_7b.run_step(name, argv, None, logs, timeout_s=left)
        report = out / "halfsafe.json" if name == "convert" else verify_json
        if step["exit"] == 0 and report.is_file():
            facts = json.loads(report.read_text())
            step.update(scale_7b.report_facts(facts))
            if name == "verify":
                result["variants"] = scale_7b.variant_facts(facts)
        result["steps"][name] = step
        save()
        if step["exit"] != 0:
            break
    if out.is_dir() and (out / "halfsafe.json").is_file() and not args.keep_output:
        shutil.rmtree(out)
    ok = all(result["steps"].get(n, {}).get("exit") == 0 for n in cmds)
    for name, s in result["steps"].items():
        print(f"{name}: exit {s.get('exit')}, {s.get('wall_s', 0):.0f} s" + "".join(
            f"; {p['name']} {p['wall_s']:.1f} s" for p in s.get("phases", [])))
    for name, v in result.get("variants", {}).items():
        print(f"  {name}: KL {v['kl_mean']}, non-finite logits {v['nonfinite_logits']}")
    print(f"wrote {path}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--out", default="bench/results/gpu.md")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a check that the script runs)")
    scale = ap.add_argument_group("--scale: convert + verify a synthetic checkpoint with the CLI")
    scale.add_argument("--scale", metavar="SIZE", help="a bench/tools/make_synthetic.py size, e.g. qwen7b or qwen7b-tiny")
    scale.add_argument("--checkpoint", help="use this checkpoint instead of writing the synthetic")
    scale.add_argument("--time-limit", type=int, default=540, help="seconds for all the steps together")
    scale.add_argument("--work", default="/tmp/halfsafe-gpu-scale")
    scale.add_argument("--results", default="bench/results")
    scale.add_argument("--samples", type=int, help="convert --max-samples (default: the CLI's)")
    scale.add_argument("--calib-seq-len", type=int, help="convert --seq-len (default: the CLI's); verify takes --seq-len")
    scale.add_argument("--verify-samples", type=int, default=1)
    scale.add_argument("--greedy-tokens", type=int, help="verify --greedy-tokens (default: the CLI's)")
    scale.add_argument("--keep-output", action="store_true")
    ap.add_argument("--vllm", metavar="PY", help="serve the Gemma 3 270M with the vLLM in this Python (bench/runtimes/vllm_cpu.py)")
    args = ap.parse_args(argv)
    if args.vllm:
        import vllm_cpu

        out = args.out if args.out != "bench/results/gpu.md" else "bench/results/gpu_vllm.md"
        vllm_cpu.main(["--vllm-python", args.vllm, "--out", out])
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: bench/cost/gpu.py has nothing to measure here", file=sys.stderr)
        return 1
    if args.scale:
        return scale_main(args)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False  # as verify does for fp16 runs
    work = Path(tempfile.mkdtemp(prefix="halfsafe-gpu-"))
    start = time.perf_counter()
    convert_checkpoint(args.model, str(work / "fp16"), device=args.device, progress=False)
    convert_s = time.perf_counter() - start
    loaded = load_model(args.model)
    ids = torch.cat(make_samples([default_text()], loaded.tokenizer, loaded.model.config.get_text_config().vocab_size,
                                 args.seq_len, args.batch))
    rows = [measure("bf16", load_model(args.model, torch.bfloat16).model, ids, args.new_tokens, device),
            measure("fp16 original", load_model(args.model, torch.float16).model, ids, args.new_tokens, device)]
    model = load_model(args.model, torch.float16).model
    with keep_residual_fp32(model):
        rows.append(measure("fp16 + fp32 residual", model, ids, args.new_tokens, device))
    del model
    rows.append(measure("halfsafe fp16", load_model(work / "fp16", torch.float16).model, ids, args.new_tokens, device))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (a check that the script runs, not a measurement)"
    lines = [f"Device: {where}, torch {torch.__version__}; {args.model}, batch {args.batch} x "
             f"{args.seq_len} tokens, {args.new_tokens} greedy tokens. `halfsafe convert --device {args.device}`: {convert_s:.1f} s.", "",
             "| variant | finite | forward tok/s | generate tok/s | peak GPU GB |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['finite']} | {r['forward_tok_s']:.0f} | {r['generate_tok_s']:.1f} | "
              f"{'n/a' if r['peak_gb'] is None else format(r['peak_gb'], '.2f')} |" for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
