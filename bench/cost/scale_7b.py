"""Convert and verify the DeepSeek-R1-Distill-Qwen-7B-architecture synthetic with the CLI, as a user runs it, under a
hard memory cap; refit the 9B / 27B time projection in docs/results.md from it.

    python bench/cost/scale_7b.py [--size qwen7b] [--cap-gb 8] [--samples N] [--seq-len N]
                             [--verify-samples 1] [--verify-seq-len 512] [--greedy-tokens N] [--readme]
    python bench/cost/scale_7b.py --report-only [--readme]     # the .md (and the docs/results.md block) again from the .json

The checkpoint (bench/tools/make_synthetic.py; kept between runs) is --checkpoint: by default /work/syn7b for qwen7b and
/tmp/halfsafe-synthetic/<name> for the other sizes; OUT is WORK/<its name>-fp16 (--work, default /tmp/halfsafe-synthetic).
The commands, with the `halfsafe` script beside this Python:

    halfsafe convert SYN OUT --device cpu --max-shard-size 5GB --overwrite [--max-samples N] [--seq-len N]
    halfsafe verify SYN OUT --device cpu --seq-len 512 --max-samples 1 --json WORK/NAME.verify.json [--greedy-tokens N]

each under a cgroup v1 memory limit (bench/tools/memory_cap.py: needs root; --cap-gb 0 runs uncapped). The limit counts
page cache: under 8 GB the 15.2 GB checkpoint cannot stay cached, so every pass over it reads it again.
Per command: exit code, wall, CPU-seconds (user + system of the command and its children), peak RSS, the cgroup's
peak; the CPU's matrix product speed per dtype (float32, bfloat16, float16; `gemm_speeds`, measured before the
commands), so that times from different CPUs read side by side; the report's "phases" and "checkpoint_reads" where the CLI writes them (convert: OUT/halfsafe.json; verify:
its --json); verify's KL to fp32 of every variant. OUT (2 bytes a parameter) is removed after verify unless
--keep-output. Writes bench/results/scale_7b.{json,md} for qwen7b, bench/results/scale_7b-SIZE.{json,md} for
another size (a test run never replaces the measurement); --results DIR writes them elsewhere.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, git_commit  # noqa: E402  (bench/cost/gpu.py reads git_commit from here too)

from make_synthetic import QWEN_SIZES, SIZES, config_for, write_checkpoint  # noqa: E402
from memory_cap import ROOT as CGROUP_ROOT  # noqa: E402
from memory_cap import run_capped  # noqa: E402

WRITES = ("scale_7b.json", "scale_7b.md", "scale_7b-*.json", "scale_7b-*.md")  # in bench/results/ (python bench/list.py)
ON_DEMAND = {"scale_7b-*.json": "--size other than qwen7b", "scale_7b-*.md": "--size other than qwen7b"}  # not in bench/results/ until run so

DEFAULT_SIZE = "qwen7b"
README_BEGIN = "<!-- scale_7b: begin"
README_END = "<!-- scale_7b: end -->"
PROJECTED = {"9B": 9e9, "27B": 27e9}  # as docs/results.md's projection names them (Gemma 2 9B, Gemma 3 27B)


class BenchError(Exception):
    """A one-line reason the bench cannot run, with the fix."""


def results_name(size: str) -> str:
    return "scale_7b" if size == DEFAULT_SIZE else f"scale_7b-{size}"


def default_checkpoint(size: str) -> Path:
    if size == DEFAULT_SIZE:
        return Path("/work/syn7b")
    return Path("/tmp/halfsafe-synthetic") / (size if size in QWEN_SIZES else f"llama-{size}")


def config_params(size: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config_for(size)).parameters())


def checkpoint_params(folder: Path) -> int:
    """Parameters stored in a safetensors checkpoint, from the file headers alone."""
    from safetensors import safe_open

    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                shape = h.get_slice(k).get_shape()
                n += math.prod(shape)
    return n


def folder_gb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9


def halfsafe_argv() -> list[str]:
    script = Path(sys.executable).parent / "halfsafe"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "halfsafe.cli"]


def commands(syn: Path, out: Path, verify_json: Path, device: str, samples: int | None, seq_len: int | None,
             verify_samples: int, verify_seq_len: int, greedy_tokens: int | None) -> dict[str, list[str]]:
    """The two commands a user types, with only the options given (the rest at the CLI's defaults)."""
    convert = [*halfsafe_argv(), "convert", str(syn), str(out), "--device", device, "--max-shard-size", "5GB", "--overwrite"]
    convert += ["--max-samples", str(samples)] if samples is not None else []
    convert += ["--seq-len", str(seq_len)] if seq_len is not None else []
    verify = [*halfsafe_argv(), "verify", str(syn), str(out), "--device", device, "--seq-len", str(verify_seq_len),
              "--max-samples", str(verify_samples), "--json", str(verify_json)]
    verify += ["--greedy-tokens", str(greedy_tokens)] if greedy_tokens is not None else []
    return {"convert": convert, "verify": verify}


def run_step(name: str, argv: list[str], cap_bytes: int | None, logs: Path, timeout_s: int | None = None) -> dict:
    """One command, measured; its output goes to logs/NAME.log (progress lines: `tail -f` it)."""
    if timeout_s:
        argv = ["timeout", "--kill-after=10", str(timeout_s), *argv]  # exit 124: the time limit
    log = logs / f"{name}.log"
    print(f"{name}: {shlex.join(argv)}\n  (output: {log})", flush=True)
    with open(log, "w") as f:
        r = run_capped(cap_bytes, argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    r["log"] = str(log)
    r["timed_out"] = bool(timeout_s) and r["exit"] in (124, 137)
    if r["exit"] != 0:
        r["log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
        print(f"{name}: exit {r['exit']}; the log ends:\n  " + "\n  ".join(r["log_tail"]), flush=True)
    print(f"{name}: exit {r['exit']}, {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} CPU-s, peak RSS {r['peak_rss_gb']:.2f} GB",
          flush=True)
    return r


def report_facts(report: dict) -> dict:
    """What a report JSON says about its own run: per-phase timings and checkpoint reads, where it has them."""
    return {k: report[k] for k in ("phases", "checkpoint_reads") if k in report}


def variant_facts(verify_report: dict) -> dict:
    """Per verify variant: KL to fp32, non-finite logits, top-1, and its forward's wall time."""
    rows = {}
    for v in verify_report.get("variants", []):
        o = v.get("overall", {})
        rows[v["name"]] = {"kl_mean": o.get("kl_mean"), "nonfinite_logits": o.get("nonfinite_logits"),
                           "top1": o.get("top1"), "forward_s": v.get("forward_seconds")}
    return rows


def per_billion(seconds: float, params: int) -> float:
    return seconds / (params / 1e9)


def projection(result: dict) -> dict:
    """Convert time scaled by parameters (the calibration the run used), from this run's convert: 9B and 27B."""
    conv = result["steps"]["convert"]
    if conv["exit"] != 0:
        return {}
    wall_b, cpu_b = per_billion(conv["wall_s"], result["params"]), per_billion(conv["cpu_s"], result["params"])
    return {"wall_s_per_billion": round(wall_b, 1), "cpu_s_per_billion": round(cpu_b, 1),
            "models": {name: {"params": p, "convert_wall_min": round(wall_b * p / 1e9 / 60, 1),
                              "convert_cpu_s": round(cpu_b * p / 1e9)} for name, p in PROJECTED.items()}}


def machine() -> dict:
    import halfsafe
    from halfsafe.verify import environment

    info = {**environment(), "halfsafe_source": str(Path(halfsafe.__file__).parent)}  # the commit below is this tree's
    try:
        info["memory_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


GEMM_SHAPE = (256, 1024, 1024)  # [m, k] x [k, n]: 0.54 GFLOP, about 1.3 s where float16 runs at 0.4 GFLOP/s
GEMM_DTYPES = ("float32", "bfloat16", "float16")


def gemm_speeds(shape: tuple[int, int, int] = GEMM_SHAPE, budget_s: float = 0.5) -> dict:
    """This CPU's matrix product speed per dtype, GFLOP/s (best of the timed calls after one warm-up, until `budget_s`
    is spent or 5 ran), on torch's threads as convert runs them: the figures beside which this machine's times read
    (bfloat16's and float16's speed against float32's is what `--calib-arith` and `--fp16-arith` measure for auto)."""
    import torch

    m, k, n = shape
    out = {"shape": list(shape), "threads": torch.get_num_threads()}
    for name in GEMM_DTYPES:
        dtype = getattr(torch, name)
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        a @ b
        best, spent, calls = math.inf, 0.0, 0
        while calls < 5 and (calls == 0 or spent < budget_s):
            t0 = time.perf_counter()
            a @ b
            dt_s = time.perf_counter() - t0
            best, spent, calls = min(best, dt_s), spent + dt_s, calls + 1
        out[name] = float(f"{2 * m * k * n / best / 1e9:.3g}")  # three significant figures, however slow
    return out


def gemm_text(g: dict | None) -> str:
    if not g:
        return "CPU matrix product speeds: not measured in this run."
    m, k, n = g["shape"]
    return (f"CPU matrix product speed ([{m} x {k}] x [{k} x {n}], {g['threads']} threads, best of a few calls): "
            + ", ".join(f"{d} {g[d]:g}" for d in GEMM_DTYPES if d in g) + " GFLOP/s.")


def _fmt(x, spec: str = ".2e") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"`{r['command']}`: the {r['architecture']} synthetic `{r['size']}` ({r['params'] / 1e9:.2f}B parameters, "
             f"{r['checkpoint_gb']:.1f} GB bf16 in {r['checkpoint_shards']} shard{'s' if r['checkpoint_shards'] != 1 else ''}; bench/tools/make_synthetic.py) converted and "
             f"verified with the CLI under a hard cgroup memory cap of {_fmt(r['cap_gb'], '.0f') if r['cap_gb'] else 'none'}"
             f"{' GB' if r['cap_gb'] else ''} (page cache included).",
             f"Machine: {m.get('cpu')}, {m.get('cpu_cores')} cores, {m.get('memory_gib', '?')} GiB, torch "
             f"{m.get('torch')}; load average {r['load_average'][0]:.1f} at start, {r['load_average'][1]:.1f} at the end "
             f"(a shared machine reads higher). Commit {r['git_commit']}, {r['started_utc']}.",
             gemm_text(r.get("gemm_gflops")), "",
             "| command | exit | wall s | CPU-s | CPU-s / B params | peak RSS GB | cgroup peak GB | checkpoint reads |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["steps"].items():
        reads = s.get("checkpoint_reads")
        total = reads.get("total", sum(v for v in reads.values() if isinstance(v, (int, float)))) if reads else None
        lines.append(f"| {name} | {s['exit']}{' (time limit)' if s.get('timed_out') else ''} | {s['wall_s']:.0f} | "
                     f"{s['cpu_s']:.0f} | {per_billion(s['cpu_s'], r['params']):.0f} | {s['peak_rss_gb']:.2f} | "
                     f"{_fmt(s.get('cgroup_peak_gb'), '.2f')} | {'not reported' if total is None else format(total, 'g')} |")
    lines += ["", "Commands:", ""]
    lines += [f"    {shlex.join(s['argv'])}" for s in r["steps"].values()]
    phases = [(name, p) for name, s in r["steps"].items() for p in s.get("phases", [])]
    if phases:
        lines += ["", "| command | phase | wall s | CPU-s |", "|---|---|---:|---:|"]
        lines += [f"| {name} | {p['name']} | {p['wall_s']:.1f} | {p['cpu_s']:.1f} |" for name, p in phases]
    else:
        lines += ["", "Per-phase timings: not in these reports (this halfsafe writes no `phases`)."]
    reads = {name: s["checkpoint_reads"] for name, s in r["steps"].items() if s.get("checkpoint_reads")}
    if reads:
        lines += ["", "Checkpoint reads (passes over its tensors) per phase: " + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:g}" for k, v in d.items()) for name, d in reads.items()) + "."]
    kl = r.get("variants", {})
    if kl:
        lines += ["", f"verify ({r['verify_samples']} x {r['verify_seq_len']} held-out tokens), per variant:", "",
                  "| variant | KL to fp32 | non-finite logits | top-1 | forward s |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {_fmt(v['kl_mean'])} | {v['nonfinite_logits']} | {_fmt(v['top1'], '.2%')} | "
                  f"{_fmt(v['forward_s'], '.1f')} |" for n, v in kl.items()]
        h, b = kl.get("halfsafe fp16", {}).get("kl_mean"), kl.get("bf16", {}).get("kl_mean")
        if h and b:
            lines += ["", f"Converted fp16 KL {h:.2e} vs bf16 {b:.2e} ({b / h:.0f}x closer to fp32)."]
    lines += ["", projection_text(r)]
    return "\n".join(lines) + "\n"


def projection_text(r: dict) -> str:
    p = r.get("projection")
    if not p:
        return "No projection: convert did not finish."
    models = "; ".join(f"{name}: ~{m['convert_wall_min']:.0f} min wall, {m['convert_cpu_s']} CPU-s"
                       for name, m in p["models"].items())
    scope = "" if r["size"] == DEFAULT_SIZE else f" (From a {r['size']} run: a check of the script, not a basis for it.)"
    return (f"Projection refitted from this convert: {p['wall_s_per_billion']:.0f} s wall and "
            f"{p['cpu_s_per_billion']:.0f} CPU-s per billion parameters on this machine (calibration: {r['calibration']}; "
            f"time grows with parameters x calibration tokens), so {models}.{scope}")


def update_readme(r: dict, readme: Path = ROOT / "docs" / "results.md") -> None:
    if r["size"] != DEFAULT_SIZE:
        raise BenchError(f"--readme takes the {DEFAULT_SIZE} run only (this one is {r['size']}): rerun with --size {DEFAULT_SIZE}")
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise BenchError(f"{readme} has no '{README_BEGIN} ... {README_END}' block to fill: add the two markers")
    head, rest = text.split(README_BEGIN, 1)
    marker_line, rest = rest.split("\n", 1)
    _, tail = rest.split(README_END, 1)
    body = markdown(r)
    readme.write_text(f"{head}{README_BEGIN}{marker_line}\n{body}{README_END}{tail}")
    print(f"updated the scale_7b block of {readme}")


def run(args: argparse.Namespace) -> dict:
    syn = Path(args.checkpoint or default_checkpoint(args.size))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    name = results_name(args.size)
    out, verify_json, logs = work / f"{syn.name}-fp16", work / f"{name}.verify.json", work / f"{name}-logs"
    logs.mkdir(exist_ok=True)
    cap = int(args.cap_gb * 1e9) if args.cap_gb else None
    if cap and not os.access(CGROUP_ROOT, os.W_OK):
        raise BenchError(f"no writable cgroup v1 memory controller at {CGROUP_ROOT} (run as root), or pass --cap-gb 0 to run uncapped")
    params = config_params(args.size)
    need = 2 * params * (1 if (syn / "config.json").is_file() else 2)  # the fp16 output (and the synthetic)
    if shutil.disk_usage(work).free < need + 1e9:
        raise BenchError(f"{work} has {shutil.disk_usage(work).free / 1e9:.1f} GB free; this run needs ~{need / 1e9:.1f} GB: "
                         f"free space or pass --work on a bigger disk")
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()[0]
    generated = None
    if not (syn / "config.json").is_file():
        print(f"writing the {args.size} synthetic into {syn} ...", flush=True)
        t0, c0 = time.time(), os.times()
        write_checkpoint(syn, args.size, "5GB" if args.size in QWEN_SIZES else "1GB")
        c1 = os.times()
        generated = {"wall_s": round(time.time() - t0, 1), "cpu_s": round(c1.user + c1.system - c0.user - c0.system, 1)}
    stored = checkpoint_params(syn)
    if stored != params:
        raise BenchError(f"{syn} holds {stored} parameters, not the {params} of --size {args.size}: pass its --size or another --checkpoint")
    cmds = commands(syn, out, verify_json, args.device, args.samples, args.seq_len, args.verify_samples,
                    args.verify_seq_len, args.greedy_tokens)
    gemm = gemm_speeds()  # before the commands: what this CPU multiplies at, beside the times below
    print(gemm_text(gemm), flush=True)
    steps = {"convert": run_step("convert", cmds["convert"], cap, logs, args.timeout_s)}
    conv = steps["convert"]
    if conv["exit"] == 0:
        saved = json.loads((out / "halfsafe.json").read_text())
        conv.update(report_facts(saved), output_gb=round(folder_gb(out), 2), output_shards=len(list(out.glob("*.safetensors"))),
                    plan_exponents=saved.get("plan", {}).get("exponents"))
        verify_json.unlink(missing_ok=True)
        steps["verify"] = run_step("verify", cmds["verify"], cap, logs, args.timeout_s)
    variants = {}
    if "verify" in steps and steps["verify"]["exit"] == 0:
        report = json.loads(verify_json.read_text())
        steps["verify"].update(report_facts(report))
        variants = variant_facts(report)
    if not args.keep_output and out.exists() and (out / "halfsafe.json").is_file():
        shutil.rmtree(out)
    result = {
        "command": shlex.join(["python", "bench/cost/scale_7b.py", *sys.argv[1:]]), "started_utc": started,
        "git_commit": git_commit(), "machine": machine(), "gemm_gflops": gemm, "load_average": [load_start, os.getloadavg()[0]],
        "size": args.size, "architecture": "DeepSeek-R1-Distill-Qwen-7B" if args.size in QWEN_SIZES else "Llama-style",
        "params": params, "checkpoint": str(syn), "checkpoint_gb": round(folder_gb(syn), 2),
        "checkpoint_shards": len(list(syn.glob("*.safetensors"))), "generated": generated, "cap_gb": cap and cap / 1e9,
        "calibration": f"{args.samples or 'the default'} samples x {args.seq_len or 'the default'} tokens"
                       + (" (the CLI's defaults, 8 x 512 at this commit)" if args.samples is None and args.seq_len is None else ""),
        "verify_samples": args.verify_samples, "verify_seq_len": args.verify_seq_len, "steps": steps, "variants": variants,
        "cpu_s_per_billion": {n: round(per_billion(s["cpu_s"], params), 1) for n, s in steps.items()},
    }
    result["projection"] = projection(result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=DEFAULT_SIZE, choices=sorted(QWEN_SIZES) + sorted(SIZES))
    ap.add_argument("--checkpoint", help="the synthetic's folder (written there when it has no config.json)")
    ap.add_argument("--work", default="/tmp/halfsafe-synthetic", help="where the fp16 output and logs go")
    ap.add_argument("--cap-gb", type=float, default=8.0, help="hard memory cap per command, page cache included (0: none)")
    ap.add_argument("--samples", type=int, help="convert --max-samples (default: the CLI's)")
    ap.add_argument("--seq-len", type=int, help="convert --seq-len (default: the CLI's)")
    ap.add_argument("--verify-samples", type=int, default=1)
    ap.add_argument("--verify-seq-len", type=int, default=512)
    ap.add_argument("--greedy-tokens", type=int, help="verify --greedy-tokens (default: the CLI's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout-s", type=int, help="time limit per command (exit 124 past it)")
    ap.add_argument("--keep-output", action="store_true", help="keep the converted fp16 folder")
    ap.add_argument("--results", default=str(RESULTS), help="where the .json and .md go (default bench/results)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md (and --readme) from the saved .json")
    ap.add_argument("--readme", action="store_true", help="also fill the scale_7b block of docs/results.md (the qwen7b run only)")
    args = ap.parse_args(argv)
    name = results_name(args.size)
    results = Path(args.results)
    try:
        if args.report_only:
            path = results / f"{name}.json"
            if not path.is_file():
                raise BenchError(f"no {path}: run python bench/cost/scale_7b.py --size {args.size} first")
            result = json.loads(path.read_text())
        else:
            result = run(args)
            results.mkdir(parents=True, exist_ok=True)
            (results / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (results / f"{name}.md").write_text(markdown(result))
        print(markdown(result))
        print(f"wrote {results / name}.md" + ("" if args.report_only else " and .json"))
        if args.readme:
            update_readme(result)
    except BenchError as e:
        print(f"scale_7b: {e}", file=sys.stderr)
        return 2
    return 0 if all(s["exit"] == 0 for s in result["steps"].values()) and "verify" in result["steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
