#!/usr/bin/env python
"""Which tiny families (tests/tiny) each runtime profile's emulation reaches: per profile, the norms, linear layers
and attention calls the emulation computed in float16 during one forward pass, or the error it raised.

A profile "reaches" a family when every norm of the kinds it covers and every linear layer ran emulated; attention
is emulated only where the modeling code calls transformers' AttentionInterface (T5-style models compute their own).
Writes bench/results/runtime_families.md. Command: `python bench/runtimes/runtime_families.py`.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, add_paths  # noqa: E402

add_paths("tests")

from tiny import TINY, make_tiny, tiny_ids  # noqa: E402

from halfsafe.core.forward import logits  # noqa: E402
from halfsafe.core.linears import is_linear  # noqa: E402
from halfsafe.engine.precision import cast_copy  # noqa: E402
from halfsafe.errors import HalfsafeError  # noqa: E402
from halfsafe.runtime import emulate  # noqa: E402
from halfsafe.runtime.emulate import emulate_runtime, is_rms_norm  # noqa: E402
from halfsafe.runtime.profiles import PROFILES  # noqa: E402

WRITES = ("runtime_families.md",)  # in bench/results/ (python bench/list.py)


def counts(model: nn.Module) -> dict:
    mods = list(model.modules())
    return {"rms": sum(map(is_rms_norm, mods)), "ln": sum(isinstance(m, nn.LayerNorm) for m in mods),
            "linear": sum(map(is_linear, mods))}


def run(model, ids, profile: str) -> tuple[Counter, bool]:
    """The emulated calls of one forward pass under `profile`, and whether its logits were finite."""
    emulate.calls.clear()
    with emulate_runtime(model, PROFILES[profile]), torch.no_grad():
        finite = bool(torch.isfinite(logits(model, ids)).all())
    return Counter(emulate.calls), finite


def main() -> None:
    rows = []
    for key in sorted(TINY):
        model = make_tiny(key)
        half = cast_copy(model, torch.float16).eval()
        ids = tiny_ids(model, 16)
        c = counts(half)
        cells = []
        for name, kinds in (("fp16-norm-stats", ("norm", "layer_norm")), ("layernorm-decomposed", ("layer_norm",)),
                            ("fp16-accumulate", ("linear",)), ("all-fp16", ("attention",))):
            try:
                n, finite = run(half, ids, name)
                done = ", ".join(f"{n[k]} {k}" for k in kinds if n[k]) or "nothing to emulate"
                cells.append(done + ("" if finite else " (non-finite)"))
            except (HalfsafeError, RuntimeError, TypeError, ValueError, KeyError) as e:
                cells.append(f"error: {str(e).splitlines()[0][:60]}")
        rows.append(f"| {key} | {c['rms']} | {c['ln']} | {c['linear']} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    head = [f"Runtime-profile emulation per tiny family (tests/tiny), one forward pass of 16 tokens in fp16. Columns: RMSNorm-type and "
            f"nn.LayerNorm modules and linear layers in the model; per profile, the calls its emulation made in float16 "
            f"(norm: an RMSNorm statistic; layer_norm; linear; attention: an eager attention in float16). "
            f"Command: `python bench/runtimes/runtime_families.py` at commit {commit}.", "",
            "| model | RMSNorm | LayerNorm | linear | fp16-norm-stats | layernorm-decomposed | fp16-accumulate | all-fp16: attention |",
            "|---|---:|---:|---:|---|---|---|---|"]
    (RESULTS / "runtime_families.md").write_text("\n".join(head + rows) + "\n")


if __name__ == "__main__":
    main()
