"""examples/web on the real Gemma 3 270M (converted, exported; the folder bench/runtimes/transformers_js.py makes) in headless
Chromium on the WASM backend, with transformers.js 3.8.1 and 4.3.2: the prompt's tokens and the greedy text against
transformers float32, and the times the page reports.

Writes bench/results/web_page.md and .json.  Usage: python bench/runtimes/web_page.py [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths  # noqa: E402

add_paths("tests", "examples/web")

import jsclient  # noqa: E402
from serve import serve_in_thread  # noqa: E402

from halfsafe.export.onnx import ONNX_FILE  # noqa: E402
from halfsafe.io.builtin import cache_dir, gemma3_270m_folder  # noqa: E402
from halfsafe.io.loading import load_model  # noqa: E402

WRITES = ("web_page.json", "web_page.md")  # in bench/results/ (python bench/list.py)

PROMPT = "Glaciers are rivers of ice that move under their own weight."


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--folder", default=str(cache_dir() / "bench-transformers-js" / "halfsafe-onnx"))
    args = ap.parse_args()
    folder = Path(args.folder)
    if not (folder / ONNX_FILE).is_file():
        print(f"{folder} has no {ONNX_FILE}: run bench/runtimes/transformers_js.py first", file=sys.stderr)
        return 2
    loaded = load_model(gemma3_270m_folder())
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:]
    want = loaded.tokenizer.decode(out, skip_special_tokens=True)
    del loaded
    server, url = serve_in_thread(folder)
    rows = []
    try:
        for lib in jsclient.VERSIONS:
            query = urllib.parse.urlencode({"lib": lib, "device": "wasm", "prompt": PROMPT, "tokens": args.tokens})
            got = jsclient.browser(f"{url}?{query}", timeout=900)
            r = got["result"]
            rows.append({"lib": lib, **r, "prompt_ids_equal": r.get("prompt_ids") == ids[0].tolist(), "text_equal": r.get("text") == want,
                         "errors": [m for m in got["logs"] if "error" in m.lower()]})
            print(rows[-1], flush=True)
    finally:
        server.shutdown()
    lines = [f"examples/web in headless Chromium ({jsclient.chromium_version()}, WASM backend), Gemma 3 270M converted "
             f"and exported by halfsafe; prompt {PROMPT!r}, {args.tokens} greedy tokens; reference transformers float32. "
             f"Command: `python bench/runtimes/web_page.py --tokens {args.tokens}`.", "",
             "| transformers.js | prompt tokens = transformers | text = transformers | load (s) | generate (s) | error |", "|---|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.get('version', r['lib'])} | {'yes' if r['prompt_ids_equal'] else 'NO'} | {'yes' if r['text_equal'] else 'NO'} "
                     f"| {r.get('load_s', float('nan')):.1f} | {r.get('generate_s', float('nan')):.1f} | {r.get('error', '-')} |")
    (RESULTS / "web_page.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "web_page.json").write_text(json.dumps({"rows": rows, "reference_text": want}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
