#!/usr/bin/env python
"""examples/web on the real Gemma 3 270M in headless Chromium on a real float16 WebGPU adapter: lavapipe under
SwiftShader's ids (scripts/install-browser-webgpu), proven in the page first (examples/web/f16_proof.html), with
transformers.js 4 and device=webgpu. The export is halfsafe's default (`halfsafe convert`, then `halfsafe export onnx`,
which splits each product's K by the ort-webgpu profile's rule: halfsafe.export.onnx_split_k).

Against transformers float32 of the original (the bf16 checkpoint's weights in float32): the prompt's tokens, one
forward's logits over the prompt (all finite? the last argmax), the greedy tokens of the page's pipeline (its text
encoded again by the tokenizer) equal to fp32's before the first difference, and the load and generate times the page
reports (the first generate compiles lavapipe's shaders unless MESA_SHADER_CACHE_DIR has them).

Writes bench/results/browser_webgpu.{md,json}.
Command: `python bench/browser_webgpu.py [--folder EXPORT] [--tokens 16]` (without --folder, the export is made in
--work on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import browser_webgpu  # noqa: E402
import jsclient  # noqa: E402
import torch  # noqa: E402
import webgpu  # noqa: E402

from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.io.builtin import gemma3_270m_folder  # noqa: E402
from halfsafe.io.loading import load_model  # noqa: E402
from halfsafe.runtime.profiles import get_profile  # noqa: E402

PROMPT = "Glaciers are rivers of ice that move under their own weight."  # bench/web_page.py's


def _export(work: Path) -> Path:
    """The default export of the default conversion, made in `work` on first use."""
    converted, folder = work / "converted", work / "default-onnx"
    if not (folder / ONNX_FILE).is_file():
        if not (converted / "halfsafe.json").is_file():
            convert_checkpoint(str(gemma3_270m_folder()), str(converted), progress=False, overwrite=True)
        export_onnx(converted, folder, overwrite=True)
    return folder


def _same_before(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", help="an export of the converted Gemma 3 270M (default: made in --work)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "halfsafe-bench-browser-webgpu"))
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    reason = browser_webgpu.missing()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    env = browser_webgpu.runtime_env()
    proof = browser_webgpu.f16_proof(env)
    if "error" in proof or webgpu.not_f16(proof["outputs"]):
        print(f"the browser's WebGPU adapter is not proven float16: {proof}", file=sys.stderr)
        return 2
    folder = Path(args.folder) if args.folder else _export(Path(args.work))

    loaded = load_model(gemma3_270m_folder())  # float32
    tokenizer = loaded.tokenizer
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = loaded.model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    del loaded

    server, url = browser_webgpu.serve(folder)
    query = urllib.parse.urlencode({"lib": "tjs4", "device": "webgpu", "prompt": PROMPT, "tokens": args.tokens, "check": "logits"})
    t0 = time.perf_counter()
    try:
        got = browser_webgpu.page(f"{url}?{query}", env, timeout=1800)
    finally:
        server.shutdown()
    wall = time.perf_counter() - t0
    r = got["result"]
    tokens = tokenizer(r.get("text", ""), add_special_tokens=False).input_ids
    row = {**r, "wall_s": wall, "prompt_ids_equal": r.get("prompt_ids") == ids[0].tolist(),
           "text_equal": r.get("text") == tokenizer.decode(want, skip_special_tokens=True),
           "greedy_equal_before_first_difference": _same_before(tokens, want),
           "errors": [m for m in got["logs"] if "error" in m.lower()]}
    machine = {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
               "chromium": jsclient.chromium_version(), "mesa": webgpu.env_file().parent.name,
               "adapter": proof["adapter"], "shader_f16": proof["shader_f16"], "f16_proof": proof["outputs"]}
    result = {"folder": str(folder), "prompt": PROMPT, "tokens": args.tokens, "reference_ids": want,
              "reference_text": tokenizer.decode(want, skip_special_tokens=True), "row": row, "machine": machine}
    logits = r.get("logits") or {}
    lines = [
        f"examples/web in headless Chromium ({machine['chromium']}) with device=webgpu on a real float16 adapter "
        f"(Mesa's lavapipe under SwiftShader's ids, {machine['mesa']}; the page's f16 proof: a sum of 4096 ones "
        f"{proof['outputs']['sum_of_ones']:g}, 300*300 {proof['outputs']['product']:g}), transformers.js "
        f"{r.get('version', '?')}; Gemma 3 270M converted and exported by halfsafe (the default split-K: "
        f"{get_profile('ort-webgpu').split_k.label}, unless --folder names another export); prompt {PROMPT!r}, {args.tokens} greedy tokens; reference "
        f"transformers float32. {machine['cpus']} CPU cores ({platform.machine()}), load average "
        f"{machine['load_avg'][0]:.1f} at the end. Command: `python bench/browser_webgpu.py {' '.join(sys.argv[1:])}`.", "",
        "| prompt tokens = fp32 | logits finite | last argmax = fp32 | greedy = fp32 before first difference | text = fp32 "
        "| load (s) | generate (s) | error |",
        "|---|---|---|---:|---|---:|---:|---|",
        f"| {'yes' if row['prompt_ids_equal'] else 'NO'} | {logits.get('finite', '-')} "
        f"| {'yes' if logits.get('argmax') == want[0] else 'NO'} | {row['greedy_equal_before_first_difference']} of {args.tokens} "
        f"| {'yes' if row['text_equal'] else 'NO'} | {r.get('load_s', float('nan')):.1f} | {r.get('generate_s', float('nan')):.1f} "
        f"| {r.get('error', '-')} |",
    ]
    (ROOT / "bench" / "results" / "browser_webgpu.md").write_text("\n".join(lines) + "\n")
    (ROOT / "bench" / "results" / "browser_webgpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
