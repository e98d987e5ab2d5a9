#!/usr/bin/env python
"""Gemma 3 270M converted with default settings: fidelity on held-out text and a long-context check.

1. `convert_checkpoint("gemma3-270m", OUT)`, as `halfsafe convert gemma3-270m OUT` does (default margin: made
   for the model's full context, see halfsafe.core.margin); the candidates table is saved.
2. `verify` on the embedded held-out text with the benchmark's settings (3 samples of up to 1024 tokens):
   bf16 and halfsafe fp16 against fp32 (the goal: KL at least 64x below bf16).
3. `verify` at --seq-len tokens (default 4096; `halfsafe verify gemma3-270m OUT --seq-len 4096 --text FILE`
   with only the halfsafe fp16 variant): the held-out text repeated to that length, one sample; the fp16
   model must stay finite at every position.

fp16 matmuls on CPU are slow: the long check takes minutes. Writes bench/results/long_context_verify.{json,md}.
Command: `python bench/fidelity/long_context_verify.py [--seq-len 4096] [--out FOLDER] [--reconvert]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, log  # noqa: E402

from halfsafe.calibration import heldout_text  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.io.builtin import cache_dir  # noqa: E402
from halfsafe.verify import BF16, HALFSAFE, environment, verify  # noqa: E402

WRITES = ("long_context_verify.json", "long_context_verify.md")  # in bench/results/ (python bench/list.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out", default=str(cache_dir() / "bench" / "gemma3-270m-fp16-default"))
    ap.add_argument("--reconvert", action="store_true")
    ap.add_argument("--skip-heldout", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    data: dict = {"command": " ".join(["python", "bench/fidelity/long_context_verify.py", *sys.argv[1:]]), "environment": environment()}
    if args.reconvert or not (out / "halfsafe.json").is_file():
        log(f"convert gemma3-270m {out}")
        t = time.perf_counter()
        convert_checkpoint("gemma3-270m", str(out), overwrite=True, progress=False)
        data["convert_seconds"] = time.perf_counter() - t
    info = json.loads((out / "halfsafe.json").read_text())
    data["margin"] = info["margin"]
    data["plan_exponents"] = info["plan"]["exponents"]
    data["candidates"] = [{"residual": c["exponents"].get("residual"), "kl_calibration_prefix": c["kl"],
                           "headroom_bits": c["headroom_bits"], "keeps_margin": c["keeps_margin"]} for c in info["candidates"]]
    log(f"plan: residual 2^{data['plan_exponents'].get('residual')}, margin {data['margin']['bits']:.2f} bits for {data['margin']['context_length']} tokens")
    if not args.skip_heldout:
        log("verify: held-out text, 3 x 1024 tokens, bf16 and halfsafe fp16")
        r = verify("gemma3-270m", str(out), seq_len=1024, max_samples=3, greedy_tokens=0, variants=[BF16, HALFSAFE], progress=log)
        bf16, hs = r.result(BF16).overall, r.result(HALFSAFE).overall
        data["heldout"] = {"tokens": sum(t["tokens"] for t in r.texts), "bf16_kl": bf16.kl_mean, "halfsafe_kl": hs.kl_mean,
                           "ratio": bf16.kl_mean / hs.kl_mean, "halfsafe_top1": hs.top1, "bf16_top1": bf16.top1,
                           "halfsafe_nonfinite": hs.nonfinite_logits,
                           "halfsafe_layer_peaks": r.result(HALFSAFE).layer_peaks}
        log(f"held-out: bf16 KL {bf16.kl_mean:.3e}, halfsafe KL {hs.kl_mean:.3e}: {bf16.kl_mean / hs.kl_mean:.1f}x lower")
    text = "\n\n".join([heldout_text()] * (args.seq_len // 2000 + 1))
    log(f"verify: {args.seq_len} tokens of the held-out text (repeated), halfsafe fp16")
    t = time.perf_counter()
    r = verify("gemma3-270m", str(out), texts=[text], text_names=["held-out text, repeated"], seq_len=args.seq_len, max_samples=1,
               greedy_tokens=0, variants=[HALFSAFE], progress=log)
    hs = r.result(HALFSAFE)
    data["long"] = {"seq_len": args.seq_len, "tokens": r.texts[0]["tokens"], "nonfinite_logits": hs.overall.nonfinite_logits,
                    "kl": hs.overall.kl_mean, "top1": hs.overall.top1, "layer_peaks": hs.layer_peaks,
                    "max_layer_peak": max(hs.layer_peaks), "seconds": time.perf_counter() - t}
    log(f"long: {data['long']['tokens']} tokens, non-finite logits {hs.overall.nonfinite_logits}, KL {hs.overall.kl_mean:.3e}, "
        f"largest residual peak {max(hs.layer_peaks):.4g}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_context_verify.json").write_text(json.dumps(data, indent=1, allow_nan=True) + "\n")
    (RESULTS / "long_context_verify.md").write_text(markdown(data))
    print(markdown(data))


def markdown(d: dict) -> str:
    m = d["margin"]
    lines = [f"Gemma 3 270M converted with default settings (`{d['command']}`): residual scale 2^{d['plan_exponents'].get('residual')}, "
             f"margin {m['bits']:.2f} bits under 65504 made for contexts up to {m['context_length']} tokens ({m['rule']}).", "",
             "| residual scale | headroom on calibration (bits) | keeps the margin | KL on the calibration prefix (128 tokens) |",
             "|---:|---:|---|---:|"]
    for c in d["candidates"]:
        lines.append(f"| 2^{c['residual']} | {c['headroom_bits']:.2f} | {'yes' if c['keeps_margin'] else 'no'} | "
                     + (f"{c['kl_calibration_prefix']:.3e} |" if c["keeps_margin"] else "not run |"))
    if "heldout" in d:
        h = d["heldout"]
        lines += ["", f"Held-out text ({h['tokens']} tokens, 3 samples of up to 1024): bf16 KL {h['bf16_kl']:.3e}, halfsafe fp16 KL "
                  f"{h['halfsafe_kl']:.3e}: **{h['ratio']:.1f}x lower**; top-1 {h['halfsafe_top1']:.2%} (bf16 {h['bf16_top1']:.2%})."]
    lg = d["long"]
    lines += ["", f"Long context: {lg['tokens']} tokens of the held-out text (repeated) in one sample, converted fp16 model: "
              f"non-finite logits {lg['nonfinite_logits']}, KL {lg['kl']:.3e}, top-1 {lg['top1']:.2%}, largest residual peak "
              f"{lg['max_layer_peak']:.4g} (65504 is fp16's max); {lg['seconds']:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
