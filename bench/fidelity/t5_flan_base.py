"""T5 at Flan-T5-base's size (tests/test_t5_depth.py's configuration at full width: 12+12 blocks, d_model 768,
gated-GELU, untied head, 32128-token vocabulary; 248M parameters), random weights grown past 65504 along the
stacks (tests/stress.py: grow_t5_stacks), saved as a bf16 checkpoint, converted by `halfsafe convert`, then scored
on the embedded held-out text against the fp32 reference: bf16, plain fp16 (T5 clamps), converted all-fp16, and
the plan re-applied with `halfsafe apply`. Writes bench/results/t5_flan_base.{json,md}.

    python bench/fidelity/t5_flan_base.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths, git_commit  # noqa: E402

add_paths("tests")

from safetensors.torch import load_file  # noqa: E402
from stress import grow_t5_stacks  # noqa: E402
from test_t5_depth import FLAN_T5_BASE_SHAPE  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402

from halfsafe.calibration import default_text, heldout_text, make_samples  # noqa: E402
from halfsafe.cli import main as cli  # noqa: E402
from halfsafe.core.forward import logits  # noqa: E402
from halfsafe.core.metrics import mean_kl, top1_agreement  # noqa: E402
from halfsafe.engine.precision import cast_copy  # noqa: E402
from halfsafe.runtime.fp16 import load_pure_fp16  # noqa: E402

WRITES = ("t5_flan_base.json", "t5_flan_base.md")  # in bench/results/ (python bench/list.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    times = {}
    model = T5ForConditionalGeneration(T5Config(**FLAN_T5_BASE_SHAPE)).eval()
    model.lm_head.weight = nn.Parameter(torch.randn_like(model.shared.weight) * 0.05)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p + torch.randn_like(p) * 0.1 * (p.dim() == 1)).bfloat16().float())
    calib = make_samples([default_text()], None, 32128, 64, 2)
    k = grow_t5_stacks(model, lambda: [logits(model, ids) for ids in calib])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    held = make_samples([heldout_text()], None, 32128, args.tokens, 2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.to(torch.bfloat16).save_pretrained(tmp / "base")
        model.float()
        t = time.time()
        assert cli(["convert", str(tmp / "base"), str(tmp / "out")]) == 0
        times["convert"] = time.time() - t
        t = time.time()
        assert cli(["apply", str(tmp / "out" / "halfsafe.json"), str(tmp / "base"), str(tmp / "again")]) == 0
        times["apply"] = time.time() - t
        a, b = load_file(tmp / "out" / "model.safetensors"), load_file(tmp / "again" / "model.safetensors")
        apply_identical = a.keys() == b.keys() and all(torch.equal(a[x], b[x]) for x in a)
        plan = json.loads((tmp / "out" / "halfsafe.json").read_text())
        variants = {"bf16": cast_copy(model, torch.bfloat16),
                    "fp16 (unconverted, all-fp16: T5 clamps)": load_pure_fp16(T5ForConditionalGeneration, tmp / "base"),
                    "halfsafe fp16 (all-fp16)": load_pure_fp16(T5ForConditionalGeneration, tmp / "out")}
        rows = {}
        t = time.time()
        refs = [logits(model, ids) for ids in held]
        for name, m in variants.items():
            outs = [logits(m, ids).float() for ids in held]
            rows[name] = {"kl": sum(mean_kl(r, o) for r, o in zip(refs, outs)) / len(refs),
                          "top1": sum(top1_agreement(r, o) for r, o in zip(refs, outs)) / len(refs),
                          "nonfinite": int(sum((~torch.isfinite(o)).sum() for o in outs))}
        times["score"] = time.time() - t
    run = {"command": "python bench/fidelity/t5_flan_base.py" + (f" --tokens {args.tokens}" if args.tokens != 64 else ""),
           "git_commit": git_commit(), "parameters": sum(p.numel() for p in model.parameters()), "growth_k": k,
           "rescaled_tensors": len(plan["plan"]["tensors"]), "apply_identical": apply_identical, "rows": rows,
           "times_s": times, "held_out_tokens": [int(ids.shape[-1]) for ids in held]}
    out = RESULTS
    (out / "t5_flan_base.json").write_text(json.dumps(run, indent=2))
    lines = [f"T5 at Flan-T5-base's size ({run['parameters'] / 1e6:.0f}M parameters, 12+12 blocks, gated-GELU, untied head), "
             f"random weights grown past 65504 along the stacks, bf16 checkpoint; `halfsafe convert` rescaled "
             f"{run['rescaled_tensors']} tensors; `halfsafe apply` of the saved plan gave "
             f"{'byte-identical' if apply_identical else 'DIFFERENT'} weights. Held-out text, {len(held)} samples of "
             f"{run['held_out_tokens']} tokens, against fp32. Command: `{run['command']}` at commit {run['git_commit']}.", "",
             "| variant | KL per token | top-1 | non-finite logits |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['kl']:.3e} | {100 * r['top1']:.2f}% | {r['nonfinite']:,} |")
    lines += ["", "Times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items())]
    (out / "t5_flan_base.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
