"""fp16 ONNX of the real Gemma 3 270M: the original, the original with Clip nodes (as published fp16 exports of
Gemma 3 have), and the halfsafe-converted checkpoint, all exported the same way (`halfsafe export onnx`).

fp16 arithmetic is computed by onnx's reference evaluator (numpy: every op's output is stored in fp16; matmuls
accumulate in fp32 and round the result to fp16, like an fp16 GEMM on a GPU). ONNX Runtime's CPU provider runs the
halfsafe graph too (it computes fp16 ops in fp32), and generates greedily with the KV cache.

Writes bench/results/onnx.md and onnx.json.  Usage: python bench/runtimes/export_onnx.py [--tokens 64] [--greedy 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

import numpy as np
import torch

from halfsafe.calibration import heldout_text, make_samples
from halfsafe.convert import convert_checkpoint
from halfsafe.core.metrics import kl_per_token, top1_agreement
from halfsafe.core.sites import find_blocks
from halfsafe.export.onnx import ONNX_FILE, export_onnx
from halfsafe.export.onnx_clamps import add_residual_clamps
from halfsafe.export.onnx_common import inspect_file, versions
from halfsafe.export.onnx_runners import OnnxDecoder
from halfsafe.io.builtin import cache_dir, gemma3_270m_folder
from halfsafe.io.loading import load_model

WRITES = ("onnx.json", "onnx.md")  # in bench/results/ (python bench/list.py)


def _metrics(ref: torch.Tensor, logits: np.ndarray) -> dict:
    out = torch.from_numpy(logits.astype(np.float32)).double().reshape(ref.shape)
    finite = torch.isfinite(out).all(-1)
    kl = kl_per_token(ref, out)
    return {
        "nonfinite_logits": int((~torch.isfinite(out)).sum()),
        "kl": float(kl.mean()) if finite.all() else float("nan"),
        "top1": top1_agreement(ref, out) if finite.all() else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="held-out tokens through the reference evaluator")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens with ONNX Runtime (halfsafe graph)")
    ap.add_argument("--work", default=str(cache_dir() / "bench-onnx"), help="where the converted checkpoint and exports go")
    args = ap.parse_args()
    work = Path(args.work)
    source = gemma3_270m_folder()
    converted = work / "gemma3-270m-halfsafe"
    if not (converted / "halfsafe.json").is_file():
        convert_checkpoint(str(source), str(converted), seq_len=512, max_samples=2, progress=False)
    timings = {}
    onnx_dirs = {"original": work / "original-onnx", "halfsafe": work / "halfsafe-onnx"}
    for name, src in (("original", source), ("halfsafe", converted)):
        if not (onnx_dirs[name] / ONNX_FILE).is_file():
            t = time.time()
            export_onnx(src, onnx_dirs[name], overwrite=True)
            timings[f"export {name}"] = time.time() - t

    loaded = load_model(source)  # fp32 reference
    ids = make_samples([heldout_text()], loaded.tokenizer, loaded.model.config.vocab_size, args.tokens, 1)[0]
    with torch.no_grad():
        ref = loaded.model(ids).logits.double()
        greedy_ref = loaded.model.generate(ids[:, :16], max_new_tokens=args.greedy, min_new_tokens=args.greedy, do_sample=False)[0, 16:].tolist()
        blocks = find_blocks(loaded.model)
        bf16 = _metrics(ref, loaded.model.to(torch.bfloat16)(ids).logits.float().numpy())
    del loaded

    import onnx

    original = onnx.load(str(onnx_dirs["original"] / ONNX_FILE))
    clamped = add_residual_clamps(original, blocks)
    clamped_dir = work / "clamped-onnx" / "onnx"
    clamped_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(clamped, str(clamped_dir / "model_fp16.onnx"))
    graphs = {
        "original fp16 ONNX": (original, onnx_dirs["original"] / ONNX_FILE, "no"),
        "clamped fp16 ONNX (Clip +-32752 on residual adds)": (clamped, clamped_dir / "model_fp16.onnx", f"yes: {2 * len(blocks)} Clip nodes in the graph"),
        "halfsafe fp16 ONNX": (None, onnx_dirs["halfsafe"] / ONNX_FILE, "no"),
    }
    del original
    rows = []
    for name, (proto, path, changes) in graphs.items():
        info = inspect_file(path)
        t = time.time()
        logits = OnnxDecoder(proto if proto is not None else path, backend="reference").logits(ids)
        timings[f"reference evaluator: {name}"] = time.time() - t
        rows.append({"variant": name, "runtime": "onnx.reference (fp16)", **_metrics(ref, logits), "clip_nodes": info["clip_nodes"],
                     "file_bytes": info["file_bytes"], "runtime_changes": changes})
        print(rows[-1], flush=True)
    del graphs, clamped
    ort = OnnxDecoder(onnx_dirs["halfsafe"] / ONNX_FILE)
    t = time.time()
    ort_logits = ort.logits(ids)
    greedy = ort.greedy(ids[:, :16], args.greedy)
    timings["onnxruntime: halfsafe logits + greedy"] = time.time() - t
    info = inspect_file(onnx_dirs["halfsafe"] / ONNX_FILE)
    rows.append({"variant": "halfsafe fp16 ONNX", "runtime": "onnxruntime CPU (fp16 ops in fp32)", **_metrics(ref, ort_logits),
                 "clip_nodes": info["clip_nodes"], "file_bytes": info["file_bytes"], "runtime_changes": "no",
                 "greedy_equal": sum(a == b for a, b in zip(greedy, greedy_ref)) if greedy == greedy_ref else
                 next(i for i, (a, b) in enumerate(zip(greedy, greedy_ref)) if a != b)})
    # PyTorch fp16 of the converted checkpoint: the figure the ONNX graph should reproduce
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        torch16 = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float16).eval()
        pt = _metrics(ref, torch16(ids).logits.float().numpy())
    rows.append({"variant": "halfsafe fp16 (PyTorch, for comparison)", "runtime": "torch CPU fp16", **pt, "clip_nodes": None,
                 "file_bytes": sum(f.stat().st_size for f in converted.glob("*.safetensors")), "runtime_changes": "no"})
    rows.append({"variant": "bf16 (PyTorch, for comparison)", "runtime": "torch CPU bf16", **bf16, "clip_nodes": None,
                 "file_bytes": None, "runtime_changes": "no"})

    header = (
        f"Gemma 3 270M, embedded held-out text: {ids.shape[1]} tokens, every position compared with the transformers float32 run "
        f"(KL(fp32 ‖ variant) per token, top-1 agreement). All three ONNX graphs are exported the same way "
        f"(`halfsafe export onnx`: transformers' OnnxExporter, torch.onnx dynamo, the model loaded in fp16); true fp16 "
        f"arithmetic by `onnx.reference.ReferenceEvaluator`. Greedy: {args.greedy} tokens from the text's first 16, ONNX "
        f"Runtime with the KV cache, against transformers fp32.\n"
        f"Machine: {platform.processor() or platform.machine()} CPU; {', '.join(f'{k} {v}' for k, v in versions().items())}. "
        f"Command: `python bench/runtimes/export_onnx.py --tokens {args.tokens} --greedy {args.greedy}`."
    )
    lines = [header, "", "| variant | runs on | non-finite logits | KL per token | top-1 | Clip nodes | size | runtime changes needed |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        size = f"{r['file_bytes'] / 2**20:,.0f} MiB" if r["file_bytes"] else "-"
        clip = "-" if r["clip_nodes"] is None else str(r["clip_nodes"])
        kl = "NaN" if r["kl"] != r["kl"] else f"{r['kl']:.2e}"
        lines.append(f"| {r['variant']} | {r['runtime']} | {r['nonfinite_logits']:,} | {kl} | {100 * r['top1']:.2f}% | {clip} | {size} | {r['runtime_changes']} |")
    g = rows[3]["greedy_equal"]
    lines += ["", f"ONNX Runtime greedy tokens of the halfsafe graph = transformers fp32: {'all ' + str(args.greedy) if greedy == greedy_ref else 'first ' + str(g)} of {args.greedy}."]
    lines += ["", "Times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "onnx.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "onnx.json").write_text(json.dumps({"rows": rows, "greedy": greedy, "greedy_fp32": greedy_ref, "timings": timings,
                                                   "tokens": int(ids.shape[1]), "versions": versions()}, indent=2, allow_nan=True) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
