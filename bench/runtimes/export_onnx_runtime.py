#!/usr/bin/env python
"""Gemma 3 270M through `halfsafe export onnx --runtime all-fp16`, run with every op in float16.

1. `convert_checkpoint("gemma3-270m", OUT/converted)` at default settings (reused when OUT holds one).
2. `export_onnx(converted, OUT/plain)` (today's export), `export_onnx(..., runtime="fp16-norm-stats")` (each norm
   prescaled by its 2^-k inside the graph) and `export_onnx(..., runtime="all-fp16")` (also the head's K split into
   products added pairwise: halfsafe.export.onnx_accumulate).
3. The graphs through `fp16_statistics` (the graph's own float32 casts and constants made float16: norm statistics,
   softmax, rotary in float16) and onnx's reference evaluator, twice: with numpy's float16 ops (whose matmul sums
   in float32) and under the all-fp16 profile's arithmetic (export.onnx_profile_ops: linears and attention
   accumulate in float16 runs of 32, float16 reductions and softmax), on the first SEQ tokens of the embedded
   held-out text; KL(fp32 transformers || graph) per token and top-1 agreement, beside PyTorch bf16 on the same
   tokens.
Writes bench/results/export_onnx_runtime.{json,md}. Command: `python bench/runtimes/export_onnx_runtime.py [--seq 32]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, log  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import torch  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.metrics import kl_per_token  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.export.onnx_norms import fp16_statistics  # noqa: E402
from halfsafe.export.onnx_runners import OnnxDecoder  # noqa: E402
from halfsafe.io.builtin import cache_dir, gemma3_270m_folder  # noqa: E402
from halfsafe.runtime.profiles import PROFILES  # noqa: E402

WRITES = ("export_onnx_runtime.json", "export_onnx_runtime.md")  # in bench/results/ (python bench/list.py)

FP32_SUMS = ("all ops fp16, matmul sums fp32", None)
FP16_SUMS = ("all ops fp16, matmul sums fp16 (all-fp16)", "all-fp16")
GRAPHS = {  # graph -> (export --runtime, the arithmetics it is run under)
    "plain": (None, (FP32_SUMS, FP16_SUMS)),
    "fp16-norm-stats": ("fp16-norm-stats", (FP32_SUMS,)),  # norms prescaled
    "all-fp16": ("all-fp16", (FP32_SUMS, FP16_SUMS)),  # norms prescaled and the head split (onnx_accumulate)
}
T0 = time.perf_counter()


def measure(ref: torch.Tensor, got: torch.Tensor) -> dict:
    finite = bool(torch.isfinite(got).all())
    out = {"finite": finite, "nonfinite_rows": int((~torch.isfinite(got).all(-1)).sum())}
    if finite:
        out["kl"] = float(kl_per_token(ref, got).mean())
        out["top1"] = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
        out["uniform_rows"] = int((got.std(-1) < 1e-3).sum())
    return out


def cell(m: dict) -> str:
    if not m["finite"]:
        return f"NaN ({m['nonfinite_rows']} rows)"
    return f"{m['kl']:.2e} ({100 * m['top1']:.0f}%)" + (f", {m['uniform_rows']} uniform rows" if m["uniform_rows"] else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(cache_dir() / "bench-export-onnx-runtime"))
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--only", choices=tuple(GRAPHS), help="measure this graph only; keep the others' rows from "
                    "results/export_onnx_runtime.json (same --seq)")
    ap.add_argument("--reuse", action="store_true", help="reuse OUT's exports from an earlier run (export reports kept beside them)")
    args = ap.parse_args()
    out = Path(args.out)
    source = gemma3_270m_folder()
    converted = out / "converted"
    if not (converted / "halfsafe.json").is_file():
        log("convert (default settings)")
        convert_checkpoint(str(source), str(converted), progress=False, overwrite=True)
    exports = {}
    for name, (runtime, _) in GRAPHS.items():
        kept = out / f"{name}.export.json"
        if args.reuse and kept.is_file() and (out / name / ONNX_FILE).is_file():
            log(f"reuse the {name} export")
        else:
            log(f"export {name}")
            kept.write_text(json.dumps(export_onnx(converted, out / name, overwrite=True, runtime=runtime).to_dict()))
        exports[name] = json.loads(kept.read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    ids = make_samples([heldout_text()], tok, tok.vocab_size, args.seq, 1)[0]
    model = AutoModelForCausalLM.from_pretrained(str(source), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids).logits.float()
        bf16 = model.to(torch.bfloat16)(ids).logits.float()
    rows = {"bf16 (PyTorch)": measure(ref, bf16)}
    if args.only:
        old = json.loads((RESULTS / "export_onnx_runtime.json").read_text())
        assert old["tokens"] == ids.shape[1], "--only keeps rows measured on the same number of tokens"
        rows.update({k: v for k, v in old["rows"].items() if " ONNX, " in k and not k.startswith(f"{args.only} ONNX")})
    for name in [n for n in exports if args.only in (None, n)]:
        proto = fp16_statistics(onnx.load(str(out / name / ONNX_FILE)))
        for label, profile in GRAPHS[name][1]:
            log(f"reference evaluator, {name}, {label}, {ids.shape[1]} tokens")
            got = OnnxDecoder(proto, backend="reference", profile=PROFILES[profile]).logits(ids.numpy()).astype(np.float32)
            rows[f"{name} ONNX, {label}"] = measure(ref, torch.from_numpy(got))
            log(f"  {rows[f'{name} ONNX, {label}']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    aware = exports["all-fp16"]
    shifts = [p["shift"] for p in aware["norm_prescales"].values()]
    data = {"commit": commit, "tokens": int(ids.shape[1]), "rows": rows, "prescales": aware["norm_prescales"],
            "head_groups": aware.get("head_groups", 1),
            "seconds": time.perf_counter() - T0}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export_onnx_runtime.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [f"Gemma 3 270M (converted at default settings) exported to ONNX, every op in float16 (fp16_statistics + "
             f"onnx's reference evaluator; matmul sums in float32 as numpy's float16 matmul adds them, or in float16 runs "
             f"of 32 as the all-fp16 profile says), {ids.shape[1]} tokens of the held-out text; KL(fp32 || variant) per token "
             f"(top-1). Command: `python bench/runtimes/export_onnx_runtime.py --seq {args.seq}` at commit {commit}. "
             f"{len(shifts)} norms prescaled, shifts {min(shifts)} .. {max(shifts)}; the head's K in "
             f"{data['head_groups']} products added pairwise.", "", "| variant | KL (top-1) |", "|---|---:|"]
    lines += [f"| {k} | {cell(v)} |" for k, v in rows.items()]
    (RESULTS / "export_onnx_runtime.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
