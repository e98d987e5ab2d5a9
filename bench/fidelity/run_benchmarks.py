#!/usr/bin/env python
"""Regenerate the results in docs/results.md: every precision variant against float32, on text never used for calibration.

    .venv/bin/python bench/fidelity/run_benchmarks.py                 # everything (CPU: ~30-60 min on 2 cores)
    .venv/bin/python bench/fidelity/run_benchmarks.py --only gemma3   # the real Gemma 3 270M only
    .venv/bin/python bench/fidelity/run_benchmarks.py --only tiny --tiny-keys llama,gemma3_text

Gemma 3 270M (the `gemma3-270m` fixture): converted with `convert_checkpoint` exactly as `halfsafe convert
gemma3-270m OUT` does (default calibration), into a cache folder keyed by a hash of halfsafe's source (reused
while the code is unchanged; --reconvert forces a new one), then `verify` on the embedded held-out text in
1024-token samples: fp32 (reference), bf16, fp16, fp16 clamp, fp16 + fp32 residual, halfsafe fp16 and halfsafe
fp16 + fp32 residual. Where CUDA is present it also measures prefill and decode tokens/s and peak GPU memory of
bf16, halfsafe fp16 and the fp32-residual variants.

Tiny families (tests/tiny): each tiny random model is made into a stress model whose residual stream is blown
up (by an exact power-of-two rescale) to 4x float16's range, so that plain fp16 overflows, then converted in
memory and verified on the held-out text (byte ids).

Writes bench/results/{gemma3-270m,tiny}.{json,md,png} (and gemma3-270m-layers.png, gemma3-270m-cuda.*), each
JSON recording the machine, versions and the exact command.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import hashlib
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, add_paths, git_commit, log  # noqa: E402

add_paths("tests")  # tests/tiny: the tiny model configs

import torch  # noqa: E402

import halfsafe  # noqa: E402
from halfsafe.calibration import default_text, heldout_text, make_samples  # noqa: E402
from halfsafe.verify import (  # noqa: E402
    ALL_VARIANTS,
    FP16,
    HALFSAFE,
    REFERENCE,
    VerifyReport,
    environment,
    markdown_table,
    verify,
    write_plots,
)

WRITES = ("gemma3-270m.json", "gemma3-270m.md", "gemma3-270m.png", "gemma3-270m-layers.png", "tiny.json", "tiny.md", "tiny.png", "gemma3-270m-cuda.*")  # in bench/results/ (python bench/list.py)
ON_DEMAND = {"gemma3-270m-cuda.*": "on a machine with a CUDA GPU (not run on one yet)"}  # not in bench/results/ until run so


def run_info() -> dict:
    info = {
        "command": " ".join(["python", "bench/fidelity/run_benchmarks.py", *map(shlex.quote, sys.argv[1:])]),
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "halfsafe_source_hash": source_hash(),
        "git_commit": git_commit(),
        **environment(torch.device("cuda") if torch.cuda.is_available() else None),
    }
    try:
        info["load_average_at_start"] = os.getloadavg()
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


# Modules that do not take part in a conversion: editing them keeps a cached conversion valid.
_NOT_CONVERSION = {"verify", "display.py", "cli.py", "plots.py", "baselines.py", "runtime.py", "training"}


def source_hash() -> str:
    """Hash of the halfsafe source a conversion runs (and the embedded texts): a cached conversion is reused only
    while it is unchanged."""
    h = hashlib.sha256()
    pkg = Path(halfsafe.__file__).parent
    for f in sorted([*pkg.rglob("*.py"), *pkg.rglob("*.txt")]):
        if f.relative_to(pkg).parts[0] in _NOT_CONVERSION:
            continue
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def write(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    log(f"wrote bench/results/{name}.json and .md")


# --- Gemma 3 270M -----------------------------------------------------------------------------------------------


def converted_gemma3(reconvert: bool) -> tuple[Path, dict]:
    from halfsafe.convert import convert_checkpoint
    from halfsafe.io.builtin import cache_dir

    folder = cache_dir() / "bench" / f"gemma3-270m-fp16-{source_hash()}"
    info = {"folder": str(folder), "settings": "convert_checkpoint('gemma3-270m', OUT) defaults (= halfsafe convert gemma3-270m OUT)"}
    if reconvert or not (folder / "halfsafe.json").is_file():
        log(f"converting gemma3-270m into {folder} ...")
        start = time.perf_counter()
        convert_checkpoint("gemma3-270m", str(folder), overwrite=True, progress=False)
        info.update(reused=False, seconds=round(time.perf_counter() - start, 1))
    else:
        log(f"reusing the conversion in {folder}")
        info["reused"] = True
    saved = json.loads((folder / "halfsafe.json").read_text())
    chosen = [c for c in saved.get("candidates", []) if {k: v for k, v in c["exponents"].items() if v} == saved["plan"]["exponents"]]
    info.update(
        residual_exponent=saved["plan"]["exponents"].get("residual"),
        tensors_rescaled=len(saved["plan"]["tensors"]),
        peak_before=saved.get("peak_before"),
        peak_after=max(saved.get("peaks_after", {0: 0}).values()),
        calibration_candidate_kl=chosen[0]["kl"] if chosen else None,
    )
    return folder, info


def gemma3_markdown(report: VerifyReport, run: dict, conversion: dict) -> str:
    t = report.texts[0]
    head = [
        f"Gemma 3 270M (the fixture: the public Q4_K_M GGUF of the bf16-pretrained model, dequantised to bf16), embedded held-out text: {t['samples']} samples of up to {report.seq_len} tokens "
        f"({t['tokens']} tokens), every variant compared with the float32 run at every position; greedy: "
        f"{report.greedy_tokens} tokens from the text's first {report.prompt_tokens}. Residual scale 2^{conversion['residual_exponent']}.",
        f"Machine: {run['cpu']} ({run['cpu_cores']} cores, {run['device']}), torch {run['torch']}, transformers "
        f"{run['transformers']}, halfsafe {run['halfsafe']}. Command: `{run['command']}` at commit {run['git_commit']}.",
        "",
        "",
    ]
    foot = ["", "Peak activations: bytes of tensors alive at once during one forward pass of the first sample, beyond the "
            "weights; the logits dominate (1024 x 262144: 1 GiB in fp32, 512 MiB in 16 bits), the fp32 residual adds "
            "a few MiB."]
    return "\n".join(head) + markdown_table(report) + "\n".join(foot) + "\n"


def bench_gemma3(args, run: dict) -> None:
    folder, conversion = converted_gemma3(args.reconvert)
    log(f"verify gemma3-270m at {args.seq_len}-token samples of the held-out text")
    report = verify("gemma3-270m", folder, seq_len=args.seq_len, max_samples=None, greedy_tokens=args.greedy_tokens,
                    progress=log)
    data = {"run": run, "conversion": conversion, "verify": report.to_dict()}
    cuda = None
    if torch.cuda.is_available():
        cuda = cuda_speed(folder, args.seq_len, args.decode_tokens)
        write("gemma3-270m-cuda", {"run": run, **cuda}, cuda_markdown(cuda, run))
    write("gemma3-270m", data, gemma3_markdown(report, run, conversion))
    for p in write_plots(report, RESULTS / "gemma3-270m.png"):
        log(f"wrote {p.relative_to(ROOT)}")
    for r in report.results:
        o = r.overall
        log(f"  {r.name:30s} KL {o.kl_mean:.3e}  top-1 {o.top1:.4f}  ppl {o.perplexity:.3f}  greedy {o.greedy_matched}/{o.greedy_total}")


@torch.no_grad()
def cuda_speed(converted: Path, seq_len: int, decode_tokens: int, device: str = "cuda") -> dict:
    """Prefill and decode tokens/s and peak GPU memory: bf16 vs halfsafe fp16 vs the fp32-residual variants.
    (`device="cpu"` runs the same code without memory figures, as a smoke test.)"""
    from halfsafe.calibration import heldout_text as held
    from halfsafe.io.loading import load_model, model_class_for, read_config
    from halfsafe.runtime.baselines import keep_residual_fp32
    from halfsafe.runtime.fp16 import load_pure_fp16
    from halfsafe.verify import greedy

    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if cuda else 0

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)

    def peak() -> int:
        return torch.cuda.max_memory_allocated(dev) if cuda else 0

    if cuda:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    original = load_model("gemma3-270m", torch.bfloat16)
    ids = make_samples([held()], original.tokenizer, original.model.config.vocab_size, seq_len, 1)[0].to(dev)
    del original

    def build(name):
        if name == "bf16":
            return load_model("gemma3-270m", torch.bfloat16).model, None
        if name == "fp16 + fp32 residual":
            return load_model("gemma3-270m", torch.float16).model, keep_residual_fp32
        m = load_pure_fp16(model_class_for(read_config(converted)), converted, local_files_only=True).eval()
        return m, keep_residual_fp32 if name.endswith("fp32 residual") else None

    out = {"seq_len": seq_len, "decode_tokens": decode_tokens, "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if cuda else None, "variants": []}
    for name in ("bf16", "halfsafe fp16", "halfsafe fp16 + fp32 residual", "fp16 + fp32 residual"):
        log(f"{dev.type}: {name}")
        model, patch = build(name)
        model.to(dev).eval()
        handle = patch(model) if patch else None
        try:
            sync()
            weights = allocated()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)  # warm-up
            sync()
            reset_peak()
            reps = 10 if cuda else 1
            start = time.perf_counter()
            for _ in range(reps):
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            sync()
            prefill = reps * ids.numel() / (time.perf_counter() - start)
            prefill_peak = peak() - weights
            reset_peak()
            start = time.perf_counter()
            greedy(model, ids[:, :16], decode_tokens)
            sync()
            decode = decode_tokens / (time.perf_counter() - start)
            out["variants"].append({
                "name": name, "custom_runtime": patch is not None, "weights_bytes": weights,
                "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
                "prefill_peak_activation_bytes": prefill_peak, "decode_peak_activation_bytes": peak() - weights,
                "finite": bool(torch.isfinite(logits).all()),
            })
        finally:
            if handle is not None:
                handle.remove()
            del model
            if cuda:
                torch.cuda.empty_cache()
    return out


def cuda_markdown(cuda: dict, run: dict) -> str:
    lines = [f"{cuda['gpu'] or cuda['device']}, prefill of {cuda['seq_len']} tokens (x10), greedy decode of {cuda['decode_tokens']} tokens; "
             f"command `{run['command']}`.", "",
             "| variant | custom runtime code | prefill tokens/s | decode tokens/s | weights | peak activations (prefill) | finite |",
             "|---|---|---:|---:|---:|---:|---|"]
    for v in cuda["variants"]:
        lines.append(f"| {v['name']} | {'yes' if v['custom_runtime'] else 'no'} | {v['prefill_tokens_per_s']:,.0f} | "
                     f"{v['decode_tokens_per_s']:,.1f} | {v['weights_bytes'] / 2**20:,.0f} MiB | "
                     f"{v['prefill_peak_activation_bytes'] / 2**20:,.0f} MiB | {v['finite']} |")
    return "\n".join(lines) + "\n"


# --- tiny families ----------------------------------------------------------------------------------------------


@torch.no_grad()
def stress_model(key: str):
    """A tiny random model made to overflow fp16 in its activations only (tests/stress.py: a few massive residual
    channels growing with depth, every weight under 65504), built without halfsafe's rescaling code."""
    from stress import make_stress
    from tiny import make_tiny

    from halfsafe.core.forward import logits

    model = make_tiny(key)
    vocab = model.config.get_text_config().vocab_size
    samples = make_samples([default_text()], None, vocab, 128, 4) + make_samples([heldout_text()], None, vocab, 128, 2)
    k = make_stress(model, lambda: [logits(model, ids) for ids in samples])
    return model, k


def bench_tiny(args, run: dict) -> None:
    from tiny import TINY

    from halfsafe.convert import make_fp16_safe
    from halfsafe.engine.precision import cast_copy

    keys = args.tiny_keys.split(",") if args.tiny_keys else sorted(TINY)
    rows, per_key = [], {}
    for key in keys:
        log(f"tiny {key}")
        try:
            model, k = stress_model(key)
            vocab = model.config.get_text_config().vocab_size
            conv = copy.deepcopy(model)
            conversion = make_fp16_safe(conv, make_samples([default_text()], None, vocab, 128, 4), progress=False, allow_unfixable=True)
            half = cast_copy(conv, torch.float16).eval()
            del conv
            report = verify(model, half, texts=[heldout_text()], text_names=["held-out text (byte ids)"], seq_len=128,
                            max_samples=2, greedy_tokens=16, prompt_tokens=16)
            overflow = sum(int((p.detach().abs() > 65504).sum()) for p in model.parameters())
            per_key[key] = {"stress_log2_factor": k, "residual_exponent": conversion.plan.exponents.get("residual"),
                            "weights_above_fp16_max": overflow,
                            "unfixable": [s for s, _ in conversion.unfixable], "verify": report.to_dict()}
            rows.append((key, report))
        except Exception as e:  # one family failing must not lose the others
            per_key[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"  {key} failed: {type(e).__name__}: {e}")
    variants = [v for v in ALL_VARIANTS if v != REFERENCE]
    md = [f"Tiny random models (tests/tiny) made to overflow float16 in their activations only (tests/stress.py: a few "
          f"massive residual channels growing with depth, every weight under 65504, at least 4x past 65504 in fp32), "
          f"converted on the embedded calibration text (bytes), verified on the held-out text (2 x 128 byte tokens). "
          f"Cells: mean KL(fp32 ‖ variant) per token, top-1 agreement; NaN: non-finite logits. "
          f"Command: `{run['command']}` at commit {run['git_commit']}.", "",
          "| model | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for key, report in rows:
        cells = []
        for v in variants:
            try:
                o = report.result(v).overall
            except KeyError:
                cells.append("-")
                continue
            cells.append("NaN" if o.nonfinite_logits else f"{o.kl_mean:.1e} ({100 * o.top1:.0f}%)")
        md.append(f"| {key} | " + " | ".join(cells) + " |")
    for key, d in per_key.items():
        if "error" in d:
            md.append(f"\n{key}: failed ({d['error'].splitlines()[0]})")
    write("tiny", {"run": run, "models": per_key}, "\n".join(md) + "\n")
    from halfsafe.plots import plot_bars

    kls = {key: report.result(HALFSAFE).overall.kl_mean for key, report in rows if HALFSAFE in [r.name for r in report.results]}
    if kls:
        plot_bars(kls, RESULTS / "tiny.png", "mean KL(fp32 || halfsafe fp16) per token", "Tiny stress models: halfsafe fp16 vs float32")
        log("wrote bench/results/tiny.png")
    broken = [key for key, r in rows if not r.result(FP16).overall.nonfinite_logits]
    if broken:
        log(f"note: plain fp16 stayed finite for {', '.join(broken)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("gemma3", "tiny"), help="run one part")
    p.add_argument("--seq-len", type=int, default=1024, help="Gemma 3 tokens per sample (default 1024)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens from the start of the text (default 32)")
    p.add_argument("--decode-tokens", type=int, default=128, help="CUDA only: tokens decoded for the speed measurement")
    p.add_argument("--tiny-keys", help="comma-separated tiny model keys (default: all)")
    p.add_argument("--reconvert", action="store_true", help="convert Gemma 3 again even if a cached conversion matches")
    args = p.parse_args()
    run = run_info()
    log(f"{run['cpu']}, {run['cpu_cores']} cores, torch {run['torch']}, transformers {run['transformers']}")
    if args.only in (None, "gemma3"):
        bench_gemma3(args, run)
    if args.only in (None, "tiny"):
        bench_tiny(args, run)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
