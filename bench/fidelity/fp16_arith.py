"""How close the emulated float16 arithmetic (halfsafe.engine.fp16_arith) is to PyTorch's float16 kernels, against how close
two of PyTorch's float16 kernels are to each other: on this CPU oneDNN's AVX512-FP16 kernels, and the same ops with
oneDNN held to AVX512_CORE (ONEDNN_MAX_CPU_ISA, set before torch starts: a second process), the kernels a CPU
without AVX512-FP16 runs. Every tiny family (tests/tiny, 24 tokens) and Gemma 3 270M (128 tokens of the embedded
text). Also the speed of one float16 matrix product both ways.

    python bench/fidelity/fp16_arith.py [--no-gemma]        (writes bench/results/fp16_arith.txt)

Differences are in float16 ulps of the logits' peak (|diff| max / (2^-10 x 2^floor(log2 peak))), with the fraction
of logits that differ at all and whether the non-finite positions agree."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths  # noqa: E402

WRITES = ("fp16_arith.txt",)  # in bench/results/ (python bench/list.py)

add_paths(".", "src")  # tests.tiny as a package, this checkout's halfsafe first


def runs(folder: Path, gemma: bool, arith: str) -> None:
    """Write every case's fp16 logits computed with `arith` into folder/<case>.pt."""
    from halfsafe.core.forward import logits
    from halfsafe.engine.precision import in_dtype
    from tests.tiny import TINY, make_tiny, tiny_ids

    torch.set_num_threads(1)
    for key in sorted(TINY):
        model = make_tiny(key)
        with in_dtype(model, torch.float16, arith) as half:
            torch.save(logits(half, tiny_ids(model, 24)), folder / f"{key}.pt")
    if gemma:
        from halfsafe.calibration import default_text
        from halfsafe.io.loading import load_model

        torch.set_num_threads(2)
        loaded = load_model("gemma3-270m", stream=True)
        ids = loaded.tokenizer(default_text(), return_tensors="pt").input_ids[:, :128]
        with in_dtype(loaded.model, torch.float16, arith) as half:
            torch.save(logits(half, ids), folder / "gemma3-270m.pt")


def ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    same_nonfinite = bool(torch.equal(torch.isfinite(a), torch.isfinite(b)))
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a.float()[keep], b.float()[keep]
    if a.numel() == 0:
        return 0.0, 0.0, same_nonfinite
    unit = 2.0 ** (math.floor(math.log2(float(a.abs().max()))) - 10)
    return float((a - b).abs().max()) / unit, float((a != b).float().mean()), same_nonfinite


def speed(isa: str | None) -> str:
    code = ("import torch,time\nx=torch.randn(512,3584);w=torch.randn(18944,3584)*0.02\nfl=2*512*3584*18944\nout=[]\n"
            "for dt in (torch.float32,torch.float16):\n a,b=x.to(dt),w.to(dt);(a@b.t())\n best=9e9\n"
            " for _ in range(3):\n  s=time.perf_counter();(a@b.t());best=min(best,time.perf_counter()-s)\n"
            " out.append(f'{dt}: {fl/best/1e9:.0f} GFLOP/s')\n"
            "a,b=x.half(),w.half();best=9e9\nfor _ in range(3):\n s=time.perf_counter();(a.float()@b.float().t()).half();best=min(best,time.perf_counter()-s)\n"
            "out.append(f'emulated float16: {fl/best/1e9:.0f} GFLOP/s')\nprint('; '.join(out))")
    env = {**os.environ, **({"ONEDNN_MAX_CPU_ISA": isa} if isa else {})}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-gemma", action="store_true")
    ap.add_argument("--_runs", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._runs:
        runs(Path(args._runs[0]), not args.no_gemma, args._runs[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, isa, arith in (("native", None, "native"), ("native AVX512_CORE", "AVX512_CORE", "native"),
                                 ("emulated", None, "emulated")):
            d = Path(tmp) / name.replace(" ", "_")
            d.mkdir()
            env = {**os.environ, **({"ONEDNN_MAX_CPU_ISA": isa} if isa else {})}
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--_runs", str(d), arith, *(["--no-gemma"] if args.no_gemma else [])],
                           env=env, check=True)
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
            dirs[name] = d
        lines = ["case | emulated vs native: ulps of peak, differing, same non-finite | native vs native AVX512_CORE | "
                 "emulated vs native AVX512_CORE"]
        for path in sorted(dirs["native"].glob("*.pt")):
            t = {k: torch.load(d / path.name) for k, d in dirs.items()}
            cells = [ulps(t["native"], t["emulated"]), ulps(t["native"], t["native AVX512_CORE"]),
                     ulps(t["native AVX512_CORE"], t["emulated"])]
            lines.append(f"{path.stem} | " + " | ".join(f"{u:.2f}, {f:.4f}, {s}" for u, f, s in cells))
    lines += ["", f"matmul [512,3584]x[3584,18944], 2 threads, best of 3 (AVX512-FP16): {speed(None)}",
              f"same, oneDNN held to AVX512_CORE: {speed('AVX512_CORE')}"]
    text = "\n".join(lines)
    print(text)
    out = RESULTS / "fp16_arith.txt"
    out.write_text(f"# python bench/fidelity/fp16_arith.py  (torch {torch.__version__})\n{text}\n")


if __name__ == "__main__":
    main()
