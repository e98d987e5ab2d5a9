#!/usr/bin/env python
"""Which tiny families (tests/tiny) each runtime profile's emulation reaches: per profile, the norms, linear layers
and attention calls the emulation computed in float16 during one forward pass, or the error it raised.

A profile "reaches" a family when every norm of the kinds it covers and every linear layer ran emulated; attention
is emulated only where the modeling code calls transformers' AttentionInterface (T5-style models compute their own).
Writes bench/results/runtime_families.md. Command: `python bench/runtime_families.py`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from halfsafe import emulate  # noqa: E402
from halfsafe.emulate import emulate_runtime, is_linear, is_rms_norm  # noqa: E402
from halfsafe.errors import HalfsafeError  # noqa: E402
from halfsafe.forward import logits  # noqa: E402
from halfsafe.precision import cast_copy  # noqa: E402
from halfsafe.runtimes import PROFILES  # noqa: E402
from tiny import TINY, make_tiny, tiny_ids  # noqa: E402


def counts(model: nn.Module) -> dict:
    mods = list(model.modules())
    return {"rms": sum(map(is_rms_norm, mods)), "ln": sum(isinstance(m, nn.LayerNorm) for m in mods),
            "linear": sum(map(is_linear, mods))}


def attention_calls(model, ids) -> int:
    calls = [0]
    original = emulate.attention16

    def counting(*a, **k):
        calls[0] += 1
        return original(*a, **k)

    from transformers import AttentionInterface

    AttentionInterface.register(emulate.ATTENTION_NAME, counting)
    try:
        with emulate_runtime(model, "all-fp16"), torch.no_grad():
            out = logits(model, ids)
    finally:
        AttentionInterface.register(emulate.ATTENTION_NAME, original)
    return calls[0], bool(torch.isfinite(out).all())


def main() -> None:
    rows = []
    for key in sorted(TINY):
        model = make_tiny(key)
        half = cast_copy(model, torch.float16).eval()
        ids = tiny_ids(model, 16)
        c = counts(half)
        cells = []
        for name in ("fp16-norm-stats", "layernorm-decomposed", "fp16-accumulate"):
            try:
                with emulate_runtime(half, name), torch.no_grad():
                    finite = bool(torch.isfinite(logits(half, ids)).all())
                cells.append("yes" + ("" if finite else " (non-finite)"))
            except (HalfsafeError, RuntimeError, TypeError, ValueError) as e:
                cells.append(f"error: {str(e).splitlines()[0][:60]}")
        try:
            n, finite = attention_calls(half, ids)
            cells.append(f"{n} attention calls" if n else "no (own attention code)")
        except (HalfsafeError, RuntimeError, TypeError, ValueError, KeyError) as e:
            cells.append(f"error: {str(e).splitlines()[0][:60]}")
        rows.append(f"| {key} | {c['rms']} | {c['ln']} | {c['linear']} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    head = [f"Runtime-profile emulation per tiny family (tests/tiny), one forward pass of 16 tokens in fp16. Columns: RMSNorm-type and "
            f"nn.LayerNorm modules and linear layers in the model; whether each profile ran; attention calls emulated under all-fp16. "
            f"Command: `python bench/runtime_families.py` at commit {commit}.", "",
            "| model | RMSNorm | LayerNorm | linear | fp16-norm-stats | layernorm-decomposed | fp16-accumulate | all-fp16 attention |",
            "|---|---:|---:|---:|---|---|---|---|"]
    (ROOT / "bench" / "results" / "runtime_families.md").write_text("\n".join(head + rows) + "\n")


if __name__ == "__main__":
    main()
