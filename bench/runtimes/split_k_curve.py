"""Split-K's accuracy per kind of product on the real Gemma 3 270M, under the `ort-webgpu` profile's emulation of ONNX
Runtime's WebGPU provider (bit for bit the runtime's: tests/test_ort_webgpu_model.py; through transformers.js too,
given its Gemma 3 positions, which start at 1).

For each rule `L,H,A` (the most terms per float16 running sum for the linears, the head and QK^T; 0: left whole)
the converted checkpoint runs once over TOKENS tokens of the embedded held-out text, emulated, and the KL(fp32 of
the original || emulated) per token (mean) and top-1 agreement are written, beside bf16's, with positions from
`--start` (0 as transformers numbers them, 1 as transformers.js does for Gemma 3). This is the curve export onnx's
default split (runtime.profiles, PROFILES["ort-webgpu"].split_k) is chosen from. One thread; ~20-60 s per rule.
Command: `python bench/runtimes/split_k_curve.py [--tokens 128] [--start 0,1] [--rules 64,64,64 64,64,128 ...]`.
Writes bench/results/split_k_curve-TOKENS.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

import torch  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.metrics import mean_kl, top1_agreement  # noqa: E402
from halfsafe.io.builtin import gemma3_270m_folder  # noqa: E402
from halfsafe.runtime.emulate import emulate_runtime  # noqa: E402
from halfsafe.runtime.profiles import SplitK, get_profile  # noqa: E402

WRITES = ("split_k_curve-*.json", "split_k_curve-*.md")  # in bench/results/ (python bench/list.py)

RULES = ("64,64,64", "64,64,128", "128,64,64", "128,64,128", "32,64,64", "64,0,64", "0,64,64", "64,64,0")
WHOLE = 1 << 30  # a bound no K reaches: the product stays whole


def rule(text: str) -> SplitK:
    return SplitK(terms=tuple(int(t) or WHOLE for t in text.split(",")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--start", default="0,1", help="first position id(s), comma-separated")
    ap.add_argument("--rules", nargs="+", default=list(RULES), help="L,H,A bounds (0: whole)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "halfsafe-bench-webgpu"),
                    help="holds the converted checkpoint (made once; bench/runtimes/webgpu.py's too)")
    args = ap.parse_args()
    source, converted = gemma3_270m_folder(), Path(args.work) / "converted"
    if not (converted / "halfsafe.json").is_file():
        convert_checkpoint(str(source), str(converted), progress=False, overwrite=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    ids = make_samples([heldout_text()], tok, tok.vocab_size, args.tokens, 1)[0]
    torch.set_num_threads(1)
    rows: dict = {}
    for start in (int(s) for s in args.start.split(",")):
        pos = torch.arange(start, start + ids.shape[1])[None]
        with torch.no_grad():
            full = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
            ref = full(ids, position_ids=pos).logits.double()
            rows.setdefault("bf16 (PyTorch)", {})[start] = {"kl": mean_kl(ref, full.to(torch.bfloat16)(ids, position_ids=pos).logits)}
            del full
            half = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float16).eval()
            for text in args.rules:
                t = time.perf_counter()
                with emulate_runtime(half, replace(get_profile("ort-webgpu"), split_k=rule(text))):
                    out = half(ids, position_ids=pos).logits.double()
                rows.setdefault(text, {})[start] = {"kl": mean_kl(ref, out), "top1": top1_agreement(ref, out),
                                                    "s": round(time.perf_counter() - t, 1)}
                print(json.dumps({"rule": text, "start": start, **rows[text][start]}), flush=True)
    write(rows, args)
    return 0


def write(rows: dict, args) -> None:
    starts = [int(s) for s in args.start.split(",")]
    default = get_profile("ort-webgpu").split_k
    lines = [f"Split-K per kind on Gemma 3 270M (halfsafe's default conversion), emulated `ort-webgpu` (bit for bit the "
             f"runtime's), {args.tokens} tokens of the embedded held-out text; KL(fp32 || variant) per token, positions "
             f"from {' and from '.join(map(str, starts))}. Rule: the most terms per float16 running sum for the linears, "
             f"the head and QK^T (0: whole). export onnx's default: {default.label}.",
             f"Machine: {platform.machine()}, torch {torch.__version__}, one thread. Command: `python bench/runtimes/split_k_curve.py "
             f"--tokens {args.tokens} --start {args.start} --rules {' '.join(args.rules)}`.", "",
             "| rule (linears, head, QK^T) | " + " | ".join(f"KL (from {s}) | top-1 (from {s})" for s in starts) + " |",
             "|---|" + "---:|---:|" * len(starts)]
    for name, by in rows.items():
        cells = [f"{by[s]['kl']:.2e} | " + (f"{100 * by[s]['top1']:.1f}%" if "top1" in by[s] else "") for s in starts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"split_k_curve-{args.tokens}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"split_k_curve-{args.tokens}.json").write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
