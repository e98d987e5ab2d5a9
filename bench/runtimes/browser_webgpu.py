#!/usr/bin/env python
"""examples/web on the real Gemma 3 270M in headless Chromium on a real float16 WebGPU adapter: lavapipe under
SwiftShader's ids (scripts/install-browser-webgpu), proven in the page first (examples/web/f16_proof.html), with
transformers.js 4 and device=webgpu. The export is halfsafe's default (`halfsafe convert`, then `halfsafe export onnx`,
which splits each product's K by the ort-webgpu profile's rule: halfsafe.export.onnx_split_k).

Against transformers float32 of the original (the bf16 checkpoint's weights in float32): the prompt's tokens, one
forward's logits over the prompt (all finite? the last argmax), the greedy tokens of the page's pipeline (its text
encoded again by the tokenizer) equal to fp32's before the first difference, and the load and generate times the page
reports (the first generate compiles lavapipe's shaders unless MESA_SHADER_CACHE_DIR has them).

`--steps N` also times what generation runs, in the same browser on the same proven adapter: a prefill (--prefill
tokens of the embedded held-out text, as bench/runtimes/webgpu.py's, no past) and a decode step (one token after a
past of --past tokens) of the plain graph (`--split-k none`, --plain) and the default export, in turn in one page for N rounds
(examples/web/time_steps.html, ONNX Runtime Web's WebGPU provider as transformers.js 4 bundles it, with the feeds of
clients/js/time_steps.mjs, whose Node figures are bench/results/webgpu.md's); each export's first run of each step
(shader compilation) is reported apart. `--keep-greedy` keeps the greedy row of the last run instead of measuring it
again (same --folder).

Writes bench/results/browser_webgpu.{md,json}.
Command: `python bench/runtimes/browser_webgpu.py [--folder EXPORT] [--tokens 16] [--steps 3 [--plain EXPORT] [--keep-greedy]]`
(without --folder or --plain, the exports are made in --work on first use).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths  # noqa: E402

add_paths("tests")

import browser_webgpu  # noqa: E402
import jsclient  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import webgpu  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.io.builtin import gemma3_270m_folder  # noqa: E402
from halfsafe.io.loading import load_model  # noqa: E402
from halfsafe.runtime.profiles import SplitK, get_profile  # noqa: E402
from halfsafe.verify.accumulator import matched_prefix  # noqa: E402

PROMPT = "Glaciers are rivers of ice that move under their own weight."  # bench/runtimes/web_page.py's
WRITES = ("browser_webgpu.json", "browser_webgpu.md")  # in bench/results/ (python bench/list.py)


def _export_folder(work: Path, plain: bool = False) -> Path:
    return work / ("plain-onnx" if plain else "default-onnx")


def _export(work: Path, plain: bool = False) -> Path:
    """The default export of the default conversion (or its plain graph, `--split-k none`), made in `work` on first use."""
    converted, folder = work / "converted", _export_folder(work, plain)
    if not (folder / ONNX_FILE).is_file():
        if not (converted / "halfsafe.json").is_file():
            convert_checkpoint(str(gemma3_270m_folder()), str(converted), progress=False, overwrite=True)
        export_onnx(converted, folder, overwrite=True, split_k=SplitK() if plain else None)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", help="an export of the converted Gemma 3 270M (default: made in --work)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "halfsafe-bench-browser-webgpu"))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0, help="also time a prefill and a decode step of the plain graph and "
                    "the default export, STEPS rounds in turn in one page (examples/web/time_steps.html)")
    ap.add_argument("--plain", help="--steps: the plain export (`--split-k none`) of the same conversion (default: made in --work)")
    ap.add_argument("--prefill", type=int, default=128, help="--steps: the prefill's tokens")
    ap.add_argument("--past", type=int, default=256, help="--steps: the decode step's past tokens")
    ap.add_argument("--keep-greedy", action="store_true", help="keep the greedy row of the last run (same --folder)")
    args = ap.parse_args()
    stored = json.loads((RESULTS / "browser_webgpu.json").read_text()) if args.keep_greedy else None
    if stored is not None and stored["folder"] != str(Path(args.folder) if args.folder else _export_folder(Path(args.work))):
        print(f"--keep-greedy: the last run's row is of {stored['folder']}, not this --folder", file=sys.stderr)
        return 2
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
    result = stored if stored is not None else greedy(folder, args.tokens, proof, env)
    if args.steps:
        plain = Path(args.plain) if args.plain else _export(Path(args.work), plain=True)
        result["steps"] = time_steps({"plain": plain, "default": folder}, args, proof, env)
    lines = greedy_lines(result) + (steps_lines(result["steps"]) if result.get("steps") else [])
    (RESULTS / "browser_webgpu.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "browser_webgpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    return 0


def greedy(folder: Path, new_tokens: int, proof: dict, env: dict) -> dict:
    """examples/web's page on `folder`: the prompt's tokens, logits, greedy tokens against transformers float32."""
    loaded = load_model(gemma3_270m_folder())  # float32
    tokenizer = loaded.tokenizer
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = loaded.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    del loaded

    server, url = browser_webgpu.serve(folder)
    query = urllib.parse.urlencode({"lib": "tjs4", "device": "webgpu", "prompt": PROMPT, "tokens": new_tokens, "check": "logits"})
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
           "greedy_equal_before_first_difference": matched_prefix(tokens, want),
           "errors": [m for m in got["logs"] if "error" in m.lower()]}
    machine = {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
               "chromium": jsclient.chromium_version(), "mesa": webgpu.env_file().parent.name,
               "adapter": proof["adapter"], "shader_f16": proof["shader_f16"], "f16_proof": proof["outputs"]}
    return {"folder": str(folder), "prompt": PROMPT, "tokens": new_tokens, "reference_ids": want,
            "reference_text": tokenizer.decode(want, skip_special_tokens=True), "row": row, "machine": machine,
            "command": f"python bench/runtimes/browser_webgpu.py {' '.join(sys.argv[1:])}"}


def greedy_lines(result: dict) -> list[str]:
    row, machine, want, n = result["row"], result["machine"], result["reference_ids"], result["tokens"]
    logits, proof = row.get("logits") or {}, machine["f16_proof"]
    command = result.get("command", f"python bench/runtimes/browser_webgpu.py --folder {result['folder']} --tokens {n}")
    return [
        f"examples/web in headless Chromium ({machine['chromium']}) with device=webgpu on a real float16 adapter "
        f"(Mesa's lavapipe under SwiftShader's ids, {machine['mesa']}; the page's f16 proof: a sum of 4096 ones "
        f"{proof['sum_of_ones']:g}, 300*300 {proof['product']:g}), transformers.js "
        f"{row.get('version', '?')}; Gemma 3 270M converted and exported by halfsafe (the default split-K: "
        f"{get_profile('ort-webgpu').split_k.label}, unless --folder names another export); prompt {PROMPT!r}, {n} greedy tokens; reference "
        f"transformers float32. {machine['cpus']} CPU cores ({platform.machine()}), load average "
        f"{machine['load_avg'][0]:.1f} at the end. Command: `{command}`.", "",
        "| prompt tokens = fp32 | logits finite | last argmax = fp32 | greedy = fp32 before first difference | text = fp32 "
        "| load (s) | generate (s) | error |",
        "|---|---|---|---:|---|---:|---:|---|",
        f"| {'yes' if row['prompt_ids_equal'] else 'NO'} | {logits.get('finite', '-')} "
        f"| {'yes' if logits.get('argmax') == want[0] else 'NO'} | {row['greedy_equal_before_first_difference']} of {n} "
        f"| {'yes' if row['text_equal'] else 'NO'} | {row.get('load_s', float('nan')):.1f} | {row.get('generate_s', float('nan')):.1f} "
        f"| {row.get('error', '-')} |",
    ]


def time_steps(folders: dict[str, Path], args, proof: dict, env: dict) -> dict:
    """examples/web/time_steps.html on `folders` (the first the baseline): the page's times, its adapter the proof's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma3_270m_folder()))
    ids = make_samples([heldout_text()], tok, tok.vocab_size, args.prefill, 1)[0][0].tolist()  # bench/runtimes/webgpu.py's
    query = urllib.parse.urlencode({"models": ",".join(folders), "ids": ",".join(map(str, ids)), "past": args.past,
                                    "rounds": args.steps})
    load_before = os.getloadavg()
    server, url = browser_webgpu.serve(folders)
    t0 = time.perf_counter()
    try:
        got = browser_webgpu.page(f"{url}time_steps.html?{query}", env, timeout=1800 + 900 * args.steps)
    finally:
        server.shutdown()
    r = got["result"]
    if "error" in r:
        raise RuntimeError(f"time_steps.html failed at {r.get('stage')}: {r['error']}\n" + "\n".join(got["logs"][-10:]))
    want = {k: proof["adapter"][k] for k in ("vendor", "architecture", "description")}
    if {k: r["adapter"][k] for k in want} != want or not r["adapter"]["shader_f16"]:
        raise RuntimeError(f"the timing page's adapter {r['adapter']} is not the proven one {proof['adapter']}")
    return {**r, "folders": {k: str(v) for k, v in folders.items()}, "wall_s": time.perf_counter() - t0,
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            "command": f"python bench/runtimes/browser_webgpu.py {' '.join(sys.argv[1:])}"}


def steps_lines(steps: dict) -> list[str]:
    """bench/runtimes/webgpu.py's steps table for the page's times, with each round's ratio and the warm-up apart."""
    base = next(iter(steps["prefill_s"]))
    before, after = steps["load_avg_before"], steps["load_avg_after"]
    lines = ["", f"Prefill of {steps['prefill']} tokens (no past) and decode step (one token after {steps['past']}) in the "
             f"same browser and adapter (examples/web/time_steps.html, ONNX Runtime Web {steps.get('version', '?')}'s WebGPU "
             f"provider; the feeds of clients/js/time_steps.mjs, positions from 0), the exports in turn in one page "
             f"({steps['rounds']} rounds after one warm-up run of each step, which compiles the shaders; median seconds, "
             f"and the median of each round's time over {base}'s). Load average (1, 5, 15 min) "
             f"{', '.join(f'{x:.1f}' for x in before)} before, {', '.join(f'{x:.1f}' for x in after)} after. "
             f"Command: `{steps['command']}`.", "",
             f"| export | decode (s) | vs {base} | decode rounds (s) | prefill (s) | vs {base} | prefill rounds (s) "
             "| warm-up decode, prefill (s) |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    for name in steps["prefill_s"]:
        cells = []
        for step in ("decode", "prefill"):
            t = steps[f"{step}_s"][name]
            ratios = steps["ratio"][step][name]
            cells += [f"{np.median(t):.3f}", f"{np.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})",
                      ", ".join(f"{x:.2f}" for x in t)]
        warm = steps["warm_s"]
        lines.append(f"| {name} | {' | '.join(cells)} | {warm['decode'][name]:.1f}, {warm['prefill'][name]:.1f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
