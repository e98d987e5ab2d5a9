"""The real Gemma 3 270M, converted by halfsafe and exported (`halfsafe export onnx`), run by transformers.js 3.x and
4.x in Node (clients/js, ONNX Runtime's CPU provider) exactly as a user loads it: `pipeline('text-generation', id)`
and `AutoModelForCausalLM` + `generate`, no options (dtype and KV-cache dtype from the folder's config.json).

Compared with transformers in float32 (the original bf16 checkpoint): the pipeline's prompt tokens (<bos>) and
text, greedy tokens of generate(), and the logits of one forward pass (KL per token, top-1 agreement), on three
held-out paragraphs. Writes bench/results/transformers_js.md and .json.

Usage: python bench/runtimes/transformers_js.py [--tokens 64] [--greedy 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths  # noqa: E402

add_paths("tests")  # tests/jsclient.py: the Node client

import jsclient  # noqa: E402

from halfsafe.calibration import heldout_text  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.metrics import kl_per_token, top1_agreement  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.export.onnx_common import versions  # noqa: E402
from halfsafe.io.builtin import cache_dir, gemma3_270m_folder  # noqa: E402
from halfsafe.io.loading import load_model  # noqa: E402
from halfsafe.verify.accumulator import matched_prefix  # noqa: E402

WRITES = ("transformers_js.json", "transformers_js.md")  # in bench/results/ (python bench/list.py)

NAMES = {"tjs3": "transformers.js 3.8.1", "tjs4": "transformers.js 4.3.2"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="tokens of each paragraph (with <bos>) for generate() and the logits")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens generated")
    ap.add_argument("--work", default=str(cache_dir() / "bench-transformers-js"), help="where the converted checkpoint and export go")
    args = ap.parse_args()
    work = Path(args.work)
    source = gemma3_270m_folder()
    converted, exported = work / "gemma3-270m-halfsafe", work / "halfsafe-onnx"
    timings = {}
    if not (converted / "halfsafe.json").is_file():
        t = time.time()
        convert_checkpoint(str(source), str(converted), seq_len=512, max_samples=2, progress=False)
        timings["convert"] = time.time() - t
    if not (exported / ONNX_FILE).is_file():
        t = time.time()
        export_onnx(converted, exported, overwrite=True)
        timings["export"] = time.time() - t

    loaded = load_model(source)  # the original in float32: the reference
    model, tokenizer = loaded.model, loaded.tokenizer
    paragraphs = [p for p in heldout_text().split("\n\n") if p.strip()][:3]
    cases = []
    with torch.no_grad():
        for text in paragraphs:
            prompt = text.split(". ")[0] + "."
            prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
            pipe_want = model.generate(prompt_ids, max_new_tokens=args.greedy, min_new_tokens=args.greedy, do_sample=False)[0, prompt_ids.shape[1]:]
            ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
            want = model.generate(ids, max_new_tokens=args.greedy, min_new_tokens=args.greedy, do_sample=False)[0, ids.shape[1]:].tolist()
            cases.append({"prompt": prompt, "prompt_ids": prompt_ids[0].tolist(), "pipeline_want": tokenizer.decode(pipe_want, skip_special_tokens=True),
                          "ids": ids, "want": want, "ref": model(ids).logits.double()})

    rows = []
    for lib in jsclient.VERSIONS:
        for n, case in enumerate(cases):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "logits.f32"
                got = jsclient.run(exported, lib, prompt=case["prompt"], ids=case["ids"][0].tolist(), new_tokens=args.greedy, logits_out=out)
                logits = torch.from_numpy(np.fromfile(out, np.float32).reshape(got["logits"]["dims"])).double()
            ref = case["ref"]
            rows.append({
                "client": NAMES[lib], "version": got["version"], "text": n + 1,
                "prompt_ids_equal": got["prompt_ids"] == case["prompt_ids"],
                "pipeline_text_equal": got["pipeline_text"] == case["pipeline_want"],
                "greedy_equal": matched_prefix(got["generate_ids"], case["want"]),
                "logits_dtype": got["logits"]["dtype"], "finite": got["logits"]["finite"],
                "kl": float(kl_per_token(ref, logits).mean()) if got["logits"]["finite"] else float("nan"),
                "top1": top1_agreement(ref, logits),
                "load_s": got["load_s"], "generate_s": got["generate_s"], "pipeline_s": got["pipeline_s"],
            })
            print(rows[-1], flush=True)

    tokens = cases[0]["ids"].shape[1]
    lines = [
        f"Gemma 3 270M converted by halfsafe, `halfsafe export onnx` (fp16, no Clip nodes), run by transformers.js in Node "
        f"{jsclient.node_version()} (ONNX Runtime CPU) with no loading options; reference: transformers float32 (the original "
        f"bf16 checkpoint). Three held-out paragraphs: `pipeline('text-generation')` on the first sentence (prompt tokens and "
        f"generated text compared), `generate()` of {args.greedy} greedy tokens after the paragraph's first {tokens} tokens, and "
        f"the logits of those {tokens} tokens (KL(fp32 ‖ client) per token, top-1 agreement).",
        f"Machine: {platform.processor() or platform.machine()} CPU, 2 cores shared; {', '.join(f'{k} {v}' for k, v in versions().items())}. "
        f"Command: `python bench/runtimes/transformers_js.py --tokens {args.tokens} --greedy {args.greedy}`.",
        "",
        "| client | text | prompt tokens = transformers | pipeline text = transformers | greedy = fp32 | logits | KL per token | top-1 | load (s) | generate (s) |",
        "|---|---:|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['client']} | {r['text']} | {'yes' if r['prompt_ids_equal'] else 'NO'} | {'yes' if r['pipeline_text_equal'] else 'NO'} "
                     f"| {r['greedy_equal']}/{args.greedy} | {r['logits_dtype']}, {'finite' if r['finite'] else 'NOT finite'} "
                     f"| {r['kl']:.2e} | {100 * r['top1']:.2f}% | {r['load_s']:.1f} | {r['generate_s']:.1f} |")
    if timings:
        lines += ["", "Times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transformers_js.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "transformers_js.json").write_text(json.dumps({"rows": rows, "timings": timings, "versions": versions(),
                                                             "node": jsclient.node_version()}, indent=2, allow_nan=True) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
