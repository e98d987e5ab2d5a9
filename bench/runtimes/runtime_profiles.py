#!/usr/bin/env python
"""Gemma 3 270M under each runtime profile: original, today's conversion, the profile-aware conversion, bf16.

1. `convert_checkpoint("gemma3-270m", OUT)` (today's default conversion; reused when OUT holds one).
2. Per profile P: `convert_checkpoint(..., runtime=P)` (the profile-aware checkpoint, or its one-line refusal), then
   `verify(..., runtime=P)` on the embedded held-out text (2 x 128 tokens: fp16 on this CPU is slow): the original
   in fp16 and today's conversion, each under P's emulated arithmetic (halfsafe.runtime.emulate), and the profile-aware
   checkpoint under P. bf16 is PyTorch's bf16 (the runtimes these profiles describe have none).
Cells: KL(fp32 || variant) per token, top-1 agreement; NaN: non-finite logits; "collapsed": finite logits whose rows
became near-uniform or whose top-1 is one token nearly everywhere (halfsafe.verify.report.Metrics.collapsed).
The profile-aware ONNX column comes from bench/results/export_onnx_runtime.json (`bench/runtimes/export_onnx_runtime.py`, 32
tokens: the reference evaluator is slow), when it is there.
Writes bench/results/runtime_profiles.{json,md}. Command: `python bench/runtimes/runtime_profiles.py [--profiles a,b]`;
`--table` rewrites the md from the two json files without measuring.
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

from halfsafe.calibration import heldout_text  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.errors import HalfsafeError  # noqa: E402
from halfsafe.io.builtin import cache_dir, gemma3_270m_folder  # noqa: E402
from halfsafe.runtime.profiles import PROFILES  # noqa: E402
from halfsafe.verify import BF16, FP16, HALFSAFE, environment, verify  # noqa: E402

WRITES = ("runtime_profiles.json", "runtime_profiles.md")  # in bench/results/ (python bench/list.py)

SEQ, SAMPLES = 128, 2


def cell(m: dict | None) -> str:
    if m is None:
        return "-"
    if m["nonfinite_logits"]:
        return f"NaN ({m['nonfinite_positions']}/{m['positions']} rows)"
    text = f"{m['kl_mean']:.2e} ({100 * m['top1']:.0f}%)"
    return text + (", collapsed" if m.get("collapsed") else "")


def overall(report, name: str) -> dict | None:
    try:
        return report.result(name).overall.to_dict()
    except KeyError:
        return None


def run_verify(folder, converted, profile: str, variants: list[str]):
    return verify(str(folder), str(converted), texts=[heldout_text()], text_names=["held-out text"], seq_len=SEQ,
                  max_samples=SAMPLES, greedy_tokens=0, variants=variants, runtime=profile, stream=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="torch,fp16-accumulate,fp16-norm-stats,all-fp16")
    ap.add_argument("--out", default=str(cache_dir() / "bench" / "gemma3-270m-fp16-default"))
    ap.add_argument("--keep", action="store_true", help="keep the rows of results/runtime_profiles.json not measured again")
    ap.add_argument("--table", action="store_true", help="only rewrite the md from the json results")
    args = ap.parse_args()
    if args.table:
        write(json.loads((RESULTS / "runtime_profiles.json").read_text()))
        return
    folder = gemma3_270m_folder()
    out = Path(args.out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    data: dict = {"command": " ".join(["python", "bench/runtimes/runtime_profiles.py", *sys.argv[1:]]), "commit": commit,
                  "environment": environment(), "tokens": f"{SAMPLES} x {SEQ}", "rows": []}
    if not (out / "halfsafe.json").is_file():
        log(f"convert gemma3-270m {out}")
        convert_checkpoint(str(folder), str(out), overwrite=True, progress=False)
    today = json.loads((out / "halfsafe.json").read_text())["plan"]["exponents"].get("residual")
    todo = args.profiles.split(",")
    if args.keep and (RESULTS / "runtime_profiles.json").is_file():
        kept = json.loads((RESULTS / "runtime_profiles.json").read_text())
        data["rows"] = [r for r in kept["rows"] if r["profile"] not in todo]
        data["kept_rows_from"] = {"command": kept["command"], "commit": kept["commit"]}
    bf16 = next((r["bf16"] for r in data["rows"] if r.get("bf16")), None)
    for name in todo:
        profile = PROFILES[name]
        row = {"profile": name, "summary": profile.summary, "today_residual": today}
        log(f"{name}: verify the original and today's conversion")
        t = time.perf_counter()
        tag = "" if profile.is_torch else f" @ {name}"
        # bf16 is PyTorch's whatever the profile: measured once (torch row, or the first row run)
        rep = run_verify(folder, out, name, ([BF16] if bf16 is None else []) + [FP16 + tag, HALFSAFE + tag])
        row["original"], row["today"] = overall(rep, FP16 + tag), overall(rep, HALFSAFE + tag)
        row["bf16"] = bf16 = overall(rep, BF16) or bf16
        row["verify_seconds"] = time.perf_counter() - t
        if profile.is_torch:
            row["aware"], row["aware_note"] = row["today"], "the same checkpoint (--runtime torch is the default)"
        else:
            aware = out.parent / f"gemma3-270m-fp16-{name}"
            log(f"{name}: convert --runtime {name}")
            t = time.perf_counter()
            try:
                report = convert_checkpoint(str(folder), str(aware), overwrite=True, progress=False, runtime=name)
                row["aware_residual"] = report.plan.exponents.get("residual")
                row["convert_seconds"] = time.perf_counter() - t
                log(f"{name}: verify the profile-aware checkpoint (residual 2^{row['aware_residual']})")
                row["aware"] = overall(run_verify(folder, aware, name, [HALFSAFE]), HALFSAFE + tag)
                row["aware_note"] = f"residual 2^{row['aware_residual']}"
            except HalfsafeError as e:
                row["convert_seconds"] = time.perf_counter() - t
                row["aware"], row["aware_note"] = None, f"refused: {e}"
        log(f"{name}: original {cell(row['original'])}, today {cell(row['today'])}, aware {cell(row['aware'])} "
            f"({row['aware_note'][:80]}), bf16 {cell(row['bf16'])}")
        data["rows"].append(row)
        data["rows"].sort(key=lambda r: list(PROFILES).index(r["profile"]))
        write(data)


ONNX_ROWS = {  # profile -> the export_onnx_runtime.json row that runs the profile-aware graph under its arithmetic
    "fp16-norm-stats": "fp16-norm-stats ONNX, all ops fp16, matmul sums fp32",
    "all-fp16": "all-fp16 ONNX, all ops fp16, matmul sums fp16 (all-fp16)",
}


def onnx_column() -> dict:
    """Profile -> cell of `export onnx --runtime` measured by bench/runtimes/export_onnx_runtime.py, plus a "note"."""
    path = RESULTS / "export_onnx_runtime.json"
    if not path.is_file():
        return {}
    onnx = json.loads(path.read_text())
    rows, n = onnx["rows"], onnx["tokens"]

    def fmt(m: dict) -> str:
        if not m["finite"]:
            return f"NaN ({m['nonfinite_rows']} rows)"
        return f"{m['kl']:.2e} ({100 * m['top1']:.0f}%)" + (f", {m['uniform_rows']} rows uniform" if m.get("uniform_rows") else "")

    bf16 = rows["bf16 (PyTorch)"]
    out = {p: f"{fmt(rows[r])} on {n} tokens (bf16 on those: {fmt(bf16)})" for p, r in ONNX_ROWS.items() if r in rows}
    plain = {p: rows["plain ONNX" + r[r.index(","):]] for p, r in ONNX_ROWS.items() if "plain ONNX" + r[r.index(","):] in rows}
    out["note"] = (f"Profile-aware ONNX: `halfsafe export onnx CONVERTED OUT --runtime P` (each norm prescaled "
                   f"inside the graph; under all-fp16 also the head's K split in {onnx.get('head_groups', 1)} products), run by onnx's reference evaluator with every op in float16 and, for all-fp16, "
                   f"matmul sums in float16 runs of 32 (halfsafe.export.onnx_profile_ops); `python "
                   f"bench/runtimes/export_onnx_runtime.py --seq {n}` at commit {onnx['commit']}. Today's export under the same "
                   f"arithmetic: " + "; ".join(f"{p} {fmt(m)}" for p, m in plain.items()) + ".")
    return out


def write(data: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "runtime_profiles.json").write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
    lines = [
        f"Gemma 3 270M under runtime profiles (halfsafe.runtime.profiles, emulated on CPU by halfsafe.runtime.emulate), embedded held-out "
        f"text, {data['tokens']} tokens, KL(fp32 ‖ variant) per token (top-1 agreement). Original and today's conversion "
        f"(residual 2^{data['rows'][0]['today_residual'] if data['rows'] else '?'}) run in fp16 under the profile; the "
        "profile-aware checkpoint is `halfsafe convert --runtime P`. bf16: PyTorch's bf16, for scale.",
        f"Command: `{data['command']}` at commit {data['commit']}"
        + (f" (rows kept from `{data['kept_rows_from']['command']}` at {data['kept_rows_from']['commit']})." if "kept_rows_from" in data else "."),
        "",
        "| profile | original fp16 | today's conversion | profile-aware checkpoint | profile-aware ONNX | bf16 |",
        "|---|---:|---:|---|---|---:|",
    ]
    onnx_cells = onnx_column()
    for r in data["rows"]:
        aware = cell(r["aware"]) + (f" ({r['aware_note']})" if r["aware"] is not None and r["profile"] != "torch" else "")
        if r["aware"] is None:
            aware = r["aware_note"]
        lines.append(f"| {r['profile']} | {cell(r['original'])} | {cell(r['today'])} | {aware} | "
                     f"{onnx_cells.get(r['profile'], 'not measured')} | {cell(r['bf16'])} |")
    if onnx_cells:
        lines += ["", onnx_cells["note"]]
    (RESULTS / "runtime_profiles.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
