"""Speed and memory on a CUDA GPU: bf16, fp16 original, fp16 + fp32 residual, and halfsafe fp16, plus the time
`halfsafe convert` takes on the GPU.

    python bench/gpu.py [MODEL] [--out bench/results/gpu.md] [--batch 8] [--seq-len 512] [--new-tokens 64]

MODEL defaults to the Gemma 3 270M fixture. Per variant: forward tokens/s on a batch of the embedded text, greedy
generation tokens/s, peak GPU memory, and whether the logits are finite. Needs a CUDA build of torch and a GPU;
on a machine without one it says so and exits 1. `--device cpu` runs the same steps on the CPU (no memory
figure): the test suite does that on a tiny model, so the script is known to run before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from halfsafe.calibration import default_text, make_samples
from halfsafe.convert import convert_checkpoint
from halfsafe.loading import load_model
from halfsafe.runtime import keep_residual_fp32


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--out", default="bench/results/gpu.md")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a check that the script runs)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: bench/gpu.py has nothing to measure here", file=sys.stderr)
        return 1
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
