#!/usr/bin/env python
"""Gemma 3 270M on ONNX Runtime's WebGPU provider (float16 arithmetic; MatMuls keep a float16 running sum over K),
through transformers.js 4 in Node (`pipeline(..., {device: 'webgpu'})`) on a software adapter: Mesa's lavapipe
(scripts/install-webgpu), which runs the same WGSL kernels a GPU would, in real float16.

Exports of the original (bf16 checkpoint, built-in fixture):
- `unconverted`: `halfsafe export onnx --split-k none` of the original itself (fp16, no rescale);
- `default`: `halfsafe convert` at default settings, then `halfsafe export onnx` (what a user gets: the split-K of
  the ort-webgpu profile);
- `plain`: the same with `--split-k none` (the graph as torch.onnx writes it);
- `all-fp16`: `export onnx --runtime all-fp16` (norms prescaled, the head's K split in 4);
- `splitk-L{l}-H{h}-A{a}`: the plain export with each product's K split in groups (halfsafe.export.onnx_split_k;
  l for the linear layers, h for the head, a for attention's QK^T), rewritten on the saved graph;
- `splitk-T{t}`: the plain export with each product's K in the fewest groups of at most t terms (SplitK(terms=t));
  `splitk-T{l}-{h}-{a}`: a bound each for the linears, the head and QK^T (SplitK(terms=(l, h, a)));
- `runtime-ort-webgpu`: `export onnx --runtime ort-webgpu` (the rewrite as the profile wires it).
Per export, on the first TOKENS tokens of the embedded held-out text: non-finite logits, KL(fp32 transformers ||
WebGPU) per token (mean), top-1 agreement, GREEDY greedy tokens of generate() (KV cache) equal to fp32's before the
first difference, and the time of one forward over the tokens (median of FORWARDS, after generate() has compiled
the shaders). Beside them, PyTorch bf16 of the original on CPU, and the default export on ONNX Runtime's CPU
provider (which computes float16 MatMuls in float32).

Exports and measured rows are kept in WORK across runs (`--variants` measures only those named; `--redo` measures
them again). `--rounds N` also times the named exports against each other: loaded in one process, then N rounds of
one forward each, in turn (clients/js/time_pair.mjs), so that a busy spell on a shared machine slows all alike; the
ratio to the default is taken round by round. `--steps N` times what generation runs instead of one forward: a prefill (--prefill tokens, no past) and a decode
step (one token after a past of --past tokens), the named exports in turn for N rounds in one process
(clients/js/time_steps.mjs, onnxruntime-node directly), on WebGPU and on ONNX Runtime's CPU provider (2 threads);
the ratio to `plain` is taken round by round. Writes bench/results/webgpu.{md,json}.
Command: `python bench/runtimes/webgpu.py [--variants plain,splitk-T64 ...] [--rounds 5] [--steps 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, add_paths, log  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

add_paths("tests")  # tests/jsclient.py: the Node client

import jsclient  # noqa: E402
import webgpu  # noqa: E402
from export_onnx_runtime import measure  # noqa: E402
from transformers_js import _agreement  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.export.onnx_common import save_program, versions  # noqa: E402
from halfsafe.export.onnx_split_k import split_matmuls_  # noqa: E402
from halfsafe.io.builtin import gemma3_270m_folder  # noqa: E402
from halfsafe.runtime.profiles import SplitK  # noqa: E402

WRITES = ("webgpu.json", "webgpu.md")  # in bench/results/ (python bench/list.py)

SPLITK = re.compile(r"^splitk-(?:L(\d+)-H(\d+)-A(\d+)|T(\d+(?:-\d+-\d+)?))$")
DEFAULT_VARIANTS = ("unconverted", "plain", "default", "splitk-T256", "splitk-T128", "splitk-T64", "splitk-T32",
                    "splitk-L16-H16-A16")


def export(work: Path, name: str, source: Path, converted: Path) -> Path:
    """The export `name` in `work` (made once, kept across runs)."""
    folder = work / name
    if (folder / ONNX_FILE).is_file():
        return folder
    log(f"export {name}")
    t = time.perf_counter()
    m = SPLITK.match(name)
    if m:  # the plain export, its graph rewritten
        import onnx_ir as ir

        plain = export(work, "plain", source, converted)
        tmp = Path(tempfile.mkdtemp(dir=work))
        shutil.copytree(plain, tmp / name)
        (tmp / name / ONNX_FILE).unlink()
        model = ir.load(str(plain / ONNX_FILE))
        rule = SplitK(terms=_terms(m[4])) if m[4] else SplitK(groups=(int(m[1]), int(m[2]), int(m[3])))
        report = split_matmuls_(model, rule)
        save_program(model, tmp / name / ONNX_FILE)
        (tmp / f"{name}.export.json").write_text(json.dumps(report.to_dict()))
        (tmp / name).rename(folder)
        (tmp / f"{name}.export.json").rename(work / f"{name}.export.json")
        tmp.rmdir()
    else:
        src = source if name == "unconverted" else converted
        runtime = {"default": None, "plain": None, "unconverted": None, "all-fp16": "all-fp16"}.get(name, name.removeprefix("runtime-"))
        split = SplitK() if name in ("plain", "unconverted") else None
        report = export_onnx(src, folder, overwrite=True, runtime=runtime, split_k=split)
        (work / f"{name}.export.json").write_text(json.dumps(report.to_dict()))
    log(f"  {time.perf_counter() - t:.0f} s")
    return folder


def run_client(folder: Path, ids: torch.Tensor, greedy: int, forwards: int, device: str | None) -> tuple[dict, torch.Tensor]:
    env = webgpu.runtime_env() if device == "webgpu" else None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.f32"
        got = jsclient.run(folder, "tjs4", ids=ids[0].tolist(), new_tokens=greedy, logits_out=out, device=device,
                           env=env, forwards=forwards, timeout=3600)
        logits = torch.from_numpy(np.fromfile(out, np.float32).reshape(got["logits"]["dims"])).double()
    return got, logits


def row_for(ref: torch.Tensor, want: list[int], got: dict, logits: torch.Tensor) -> dict:
    row = measure(ref, logits)
    row["nonfinite"] = int((~torch.isfinite(logits)).sum())
    row["greedy"] = _agreement(got["generate_ids"], want) if "generate_ids" in got else None
    row["greedy_of"] = len(want)
    row["forward_s"] = float(np.median(got["forward_s"]))
    row["forward_all_s"] = got["forward_s"]
    row["generate_s"], row["load_s"] = got.get("generate_s"), got["load_s"]
    return row


def fmt(name: str, r: dict, greedy: int) -> str:
    if "error" in r:
        return f"| {name} | {r.get('device', '')} | failed: {r['error'][-160:]} | | | | |"
    kl = f"{r['kl']:.2e}" if r.get("finite") else "—"
    top1 = f"{100 * r['top1']:.1f}%" if r.get("finite") else "—"
    t = f"{r['forward_s']:.2f}" if r.get("forward_s") is not None else "—"
    agree = f"{r['greedy']}/{r.get('greedy_of', greedy)}" if r.get("greedy") is not None else "—"
    return f"| {name} | {r.get('device', '')} | {r['nonfinite']} | {kl} | {top1} | {agree} | {t} |"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "halfsafe-bench-webgpu"),
                    help="where the converted checkpoint, the exports and the measured rows are kept")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--forwards", type=int, default=3)
    ap.add_argument("--redo", action="store_true", help="measure the named variants again")
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time the named variants against each other: ROUNDS rounds of one forward each, in turn, "
                         "in one process (clients/js/time_pair.mjs), so that other work on the machine slows all alike")
    ap.add_argument("--steps", type=int, default=0,
                    help="also time a prefill and a decode step of the named variants, STEPS rounds in turn in one "
                         "process, on WebGPU and on ONNX Runtime's CPU provider (clients/js/time_steps.mjs)")
    ap.add_argument("--prefill", type=int, default=128, help="--steps: the prefill's tokens")
    ap.add_argument("--past", type=int, default=256, help="--steps: the decode step's past tokens")
    args = ap.parse_args()
    if webgpu.adapter_missing():
        sys.exit(webgpu.adapter_missing())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = gemma3_270m_folder()
    converted = work / "converted"
    if not (converted / "halfsafe.json").is_file():
        log("convert (default settings)")
        convert_checkpoint(str(source), str(converted), progress=False, overwrite=True)
    names = [v for v in args.variants.split(",") if v]
    folders = {n: export(work, n, source, converted) for n in names}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    ids = make_samples([heldout_text()], tok, tok.vocab_size, args.tokens, 1)[0]
    stored = work / f"rows-{args.tokens}.json"  # a row measured with --greedy 0 keeps its greedy column empty
    rows = json.loads(stored.read_text()) if stored.is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(str(source), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids).logits.double()
        want = model.generate(ids, max_new_tokens=args.greedy, min_new_tokens=args.greedy, do_sample=False)[0, ids.shape[1]:].tolist() if args.greedy else []
        if args.greedy and ("bf16 (PyTorch)" not in rows or args.redo):
            m16 = model.to(torch.bfloat16)
            t = time.perf_counter()
            bf16 = m16(ids).logits.double()
            row = measure(ref, bf16)
            row.update(device="CPU (PyTorch)", nonfinite=int((~torch.isfinite(bf16)).sum()), forward_s=time.perf_counter() - t,
                       greedy=_agreement(m16.generate(ids, max_new_tokens=args.greedy, min_new_tokens=args.greedy,
                                                      do_sample=False)[0, ids.shape[1]:].tolist(), want))
            rows["bf16 (PyTorch)"] = row
    del model
    runs = [(n, "webgpu") for n in names] + ([("default", None)] if "default" in names else [])
    for name, device in runs:
        key = f"{name} @ {device or 'cpu'}"
        if key in rows and not args.redo and (rows[key].get("greedy") is not None or not args.greedy):
            continue
        log(f"{key}: transformers.js, {ids.shape[1]} tokens, {args.greedy} greedy")
        try:
            got, logits = run_client(folders[name], ids, args.greedy, args.forwards, device)
            rows[key] = row_for(ref, want, got, logits)
        except RuntimeError as e:  # the runtime refused the graph: its reason is the row
            reason = next((ln.strip() for ln in str(e).splitlines() if "Error:" in ln), str(e).splitlines()[-1])
            rows[key] = {"error": reason[:300], "nonfinite": None, "greedy": None}
        rows[key]["device"] = "WebGPU (lavapipe)" if device else "ORT CPU"
        exported = work / f"{name}.export.json"
        rows[key]["export"] = json.loads(exported.read_text()) if exported.is_file() else {}
        log(f"  {({k: v for k, v in rows[key].items() if k != 'export'})}")
        stored.write_text(json.dumps(rows, indent=1))
    stored.write_text(json.dumps(rows, indent=1))
    timed = work / f"timing-{args.tokens}.json"
    timing = json.loads(timed.read_text()) if timed.is_file() else None
    if args.rounds:
        timing = time_in_turn(folders, ids, args.rounds)
        timed.write_text(json.dumps(timing, indent=1))
    stepped = work / f"steps-{args.prefill}-{args.past}.json"
    steps = json.loads(stepped.read_text()) if stepped.is_file() else None
    if args.steps:
        long_ids = make_samples([heldout_text()], tok, tok.vocab_size, args.prefill, 1)[0]
        steps = {device: time_steps(folders, long_ids, args.past, args.steps, device) for device in ("webgpu", "cpu")}
        stepped.write_text(json.dumps(steps, indent=1))
    write_results(rows, ids, args, timing, steps)
    return 0


def _terms(text: str) -> int | tuple[int, int, int]:
    """`T` of splitk-T64 (one bound) or splitk-T128-64-64 (linears, head, QK^T)."""
    bounds = tuple(int(t) for t in text.split("-"))
    return bounds[0] if len(bounds) == 1 else bounds


def time_in_turn(folders: dict[str, Path], ids: torch.Tensor, rounds: int) -> dict:
    """Each export's forward time over `ids` on WebGPU, the exports run in turn for `rounds` rounds in one process."""
    log(f"timing {', '.join(folders)} in turn, {rounds} rounds")
    args = {"folders": [str(f) for f in folders.values()], "lib": "tjs4", "ids": ids[0].tolist(), "rounds": rounds,
            "device": "webgpu"}
    done = subprocess.run(["node", str(jsclient.CLIENTS / "time_pair.mjs"), json.dumps(args)], cwd=jsclient.CLIENTS,
                          capture_output=True, text=True, timeout=7200, env=webgpu.runtime_env())
    if done.returncode != 0:
        raise RuntimeError(f"time_pair.mjs failed:\n{done.stderr[-4000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {"rounds": rounds, "load": os.getloadavg(),
            "forward_s": {name: got["forward_s"][str(f)] for name, f in folders.items()}}


def time_steps(folders: dict[str, Path], ids: torch.Tensor, past: int, rounds: int, device: str) -> dict:
    """Each export's prefill over `ids` and decode step after `past` tokens on `device`, in turn for `rounds` rounds
    in one process (clients/js/time_steps.mjs). On the CPU provider (a float32 copy of every weight per session: five
    sessions of Gemma 3 270M outgrow 23 GB) each export is timed in a process of its own beside `plain`, whose times
    of that process are its baseline (`base_prefill_s`, `base_decode_s`)."""
    if device == "cpu" and "plain" in folders and len(folders) > 2:
        out: dict = {}
        for name in folders:
            if name == "plain":
                continue
            got = time_steps({"plain": folders["plain"], name: folders[name]}, ids, past, rounds, device)
            for key in ("prefill_s", "decode_s", "warm_s"):
                out.setdefault(key, {})[name] = got[key][name]
                if key != "warm_s":
                    out.setdefault(f"base_{key}", {})[name] = got[key]["plain"]
            out.update({k: got[k] for k in ("rounds", "prefill", "past", "load")})
        for key in ("prefill_s", "decode_s"):  # plain's row: its times in every process, each its own baseline
            out[key] = {"plain": [t for ts in out[f"base_{key}"].values() for t in ts], **out[key]}
            out[f"base_{key}"]["plain"] = out[key]["plain"]
        return out
    import onnx

    log(f"steps on {device}: {', '.join(folders)} in turn, {rounds} rounds, prefill {ids.shape[1]}, past {past}")
    graph = onnx.load(str(next(iter(folders.values())) / ONNX_FILE), load_external_data=False).graph
    kv = [v for v in graph.input if v.name.startswith("past_key_values")]
    dims = [d.dim_value for d in kv[0].type.tensor_type.shape.dim]
    args = {"models": {name: str(f / ONNX_FILE) for name, f in folders.items()}, "device": device, "ids": ids[0].tolist(),
            "past": past, "rounds": rounds, "kv": {"heads": dims[1], "dim": dims[3], "layers": [v.name for v in kv]},
            "threads": 2 if device == "cpu" else None}
    done = subprocess.run(["node", str(jsclient.CLIENTS / "time_steps.mjs"), json.dumps(args)], cwd=jsclient.CLIENTS,
                          capture_output=True, text=True, timeout=7200, env=webgpu.runtime_env())
    if done.returncode != 0:
        raise RuntimeError(f"time_steps.mjs failed:\n{done.stderr[-4000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"  {got}")
    return {"rounds": rounds, "prefill": int(ids.shape[1]), "past": past, "load": os.getloadavg(), **got}


def steps_lines(steps: dict) -> list[str]:
    """Prefill and decode times per provider: median seconds, and the median of each round's ratio to `plain`."""
    lines = []
    for device, got in steps.items():
        lines += ["", f"{'WebGPU (lavapipe)' if device == 'webgpu' else 'ONNX Runtime CPU provider (2 threads)'}: a "
                  f"prefill of {got['prefill']} tokens and a decode step (one token after {got['past']}), the exports in "
                  f"turn in one process ({got['rounds']} rounds; median seconds, and the median of each round's time "
                  "over plain's):", "",
                  "| variant | decode (s) | vs plain | prefill (s) | vs plain |", "|---|---:|---:|---:|---:|"]
        for name in got["prefill_s"]:
            cells = []
            for step in ("decode_s", "prefill_s"):
                t, base = got[step][name], got.get(f"base_{step}", {}).get(name, got[step].get("plain"))
                rel = f"{np.median([a / b for a, b in zip(t, base)]):.2f}x" if base else ""
                cells += [f"{np.median(t):.3f}", rel]
            lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


def timing_lines(timing: dict) -> list[str]:
    """The forward times measured in turn: median per export, and the median of each round's ratio to the default."""
    times = timing["forward_s"]
    ref = "plain" if "plain" in times else "default"
    base = times.get(ref)
    lines = ["", f"Forward time over the same tokens, the exports run in turn in one process ({timing['rounds']} rounds, "
             f"each export once per round; median seconds, and the median of each round's time over {ref}'s):", "",
             f"| variant | forward (s), median | vs {ref}, per round (median) | rounds (s) |", "|---|---:|---:|---|"]
    for name, t in times.items():
        rel = f"{np.median([a / b for a, b in zip(t, base)]):.2f}x" if base else ""
        lines.append(f"| {name} | {np.median(t):.2f} | {rel} | {', '.join(f'{x:.1f}' for x in t)} |")
    return lines


def write_results(rows: dict, ids: torch.Tensor, args, timing: dict | None = None, steps: dict | None = None) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    ort = json.loads((ROOT / "clients" / "js" / "node_modules" / "tjs4" / "node_modules" / "onnxruntime-node" /
                      "package.json").read_text())["version"]
    lines = [
        f"Gemma 3 270M (the original bf16 checkpoint) through transformers.js 4 in Node {jsclient.node_version()}, "
        f"`device: 'webgpu'`: onnxruntime-node {ort}'s WebGPU provider (Dawn) on Mesa 25.0.7's lavapipe, a CPU Vulkan "
        f"driver with float16 (scripts/install-webgpu): the WGSL kernels of a GPU, in real float16. {ids.shape[1]} tokens "
        f"of the embedded held-out text; reference: transformers float32 of the original. KL(fp32 ‖ variant) per token "
        f"(mean), top-1 agreement, greedy tokens of generate() equal to fp32's before the first difference, and the time "
        f"of one forward over the {ids.shape[1]} tokens (median of {args.forwards}, shaders compiled).",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs (times "
        f"are noisy); {', '.join(f'{k} {v}' for k, v in versions().items())}. "
        f"Command: `python bench/runtimes/webgpu.py --tokens {args.tokens} --greedy {args.greedy} --forwards {args.forwards}` "
        f"at commit {commit}.",
        "",
        "| variant | runtime | non-finite logits | KL per token | top-1 | greedy = fp32 | forward (s), in its own run |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():  # rows measured in different runs: their times compare nothing (see the in-turn tables)
        lines.append(fmt(name.removesuffix(" @ webgpu"), r, args.greedy))
    if timing:
        lines += timing_lines(timing)
    if steps:
        lines += steps_lines(steps)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "webgpu.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "webgpu.json").write_text(json.dumps({"commit": commit, "tokens": int(ids.shape[1]), "rows": rows,
                                                     "timing": timing, "steps": steps},
                                                    indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
