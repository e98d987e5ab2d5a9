#!/usr/bin/env python
"""Loss curves of a short fine-tune under fp32, bf16 autocast and fp16 AMP (autocast + GradScaler), the last
before and after halfsafe's exact conversion, on the same batches in the same order.

    .venv/bin/python bench/training/finetune_curves.py                        # Gemma 3 270M (the fixture), CPU defaults
    .venv/bin/python bench/training/finetune_curves.py --steps 20 --fp16-steps 20 --seq-len 128   # on a GPU
    .venv/bin/python bench/training/finetune_curves.py --model tiny:llama     # a tiny stress model (seconds)

Every run starts from the same float32 weights with AdamW (same lr, grad clipping at 1.0), one batch per
step, the batches cycled so the loss visibly falls. The converted run keeps the optimizer in the
original model's coordinates (`keep_coordinates`), so its curve is comparable step by step with the
original's fp32 curve. float16 matmuls are ~30-100x slower than float32 on CPUs without AVX512-FP16, so on
a CPU the two fp16 runs default to a few steps (--fp16-steps); fp32 and bf16 run all --steps.

Writes bench/results/finetune_curves.{json,png} (or --out).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths, log  # noqa: E402

add_paths("tests")

import torch  # noqa: E402

from halfsafe.calibration import default_text, make_samples  # noqa: E402
from halfsafe.convert import make_fp16_safe  # noqa: E402
from halfsafe.training import train_steps  # noqa: E402

WRITES = ("finetune_curves*.json", "finetune_curves*.png")  # in bench/results/ (python bench/list.py)


def load(name: str, seq_len: int, n_batches: int, batch: int):
    if name.startswith("tiny:"):
        from test_finetune import _stress

        model = _stress(name.split(":", 1)[1])
        tokenizer = None
    else:
        from halfsafe.io.loading import load_model

        loaded = load_model(name)
        model, tokenizer = loaded.model, loaded.tokenizer
    vocab = model.config.get_text_config().vocab_size
    rows = make_samples([default_text()], tokenizer, vocab, seq_len, n_batches * batch)
    rows = [r for r in rows if r.shape[1] == seq_len]
    batches = [torch.cat(rows[i * batch:(i + 1) * batch]) for i in range(len(rows) // batch)]
    return model, batches


def rel_dev(losses: list[float], ref: list[float]) -> float:
    pairs = [(a, b) for a, b in zip(losses, ref)]
    if not pairs or not all(math.isfinite(a) for a, _ in pairs):
        return math.inf
    return max(abs(a - b) / abs(b) for a, b in pairs)


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    finite_all = [x for r in runs.values() for x in r["losses"] if math.isfinite(x)]
    top = max(finite_all) if finite_all else 1.0
    styles = {"fp32": ("k", "-", "o"), "bf16": ("tab:blue", "-", "s"), "fp16 original": ("tab:red", "--", "x"),
              "fp16 halfsafe": ("tab:green", "-", "^")}
    for label, r in runs.items():
        color, ls, marker = styles.get(label, (None, "-", "."))
        xs = list(range(1, len(r["losses"]) + 1))
        ys = [x if math.isfinite(x) else float("nan") for x in r["losses"]]
        ax.plot(xs, ys, color=color, ls=ls, marker=marker, ms=4, label=label)
        skipped = [(x, y) for x, y, sk in zip(xs, ys, r.get("skipped", [])) if sk and math.isfinite(y)]
        if skipped:
            ax.scatter([x for x, _ in skipped], [y for _, y in skipped], s=90, facecolors="none", edgecolors=color,
                       label=f"{label}: update skipped by GradScaler ({len(skipped)})")
        bad = [x for x, y in zip(xs, r["losses"]) if not math.isfinite(y)]
        if bad:
            ax.scatter(bad, [top * 1.02] * len(bad), color=color, marker="v", s=40,
                       label=f"{label}: loss inf/NaN ({len(bad)} steps)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _title(r: dict) -> str:
    scale = r.get("init_scale", 2.0 ** 16)
    return (f"{r['model']}: fine-tune loss, seq {r['seq_len']}, lr {r['lr']:g}, "
            f"GradScaler init {scale:g} ({r['device']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="gemma3-270m, a model folder, or tiny:<key> (a tiny stress model)")
    ap.add_argument("--steps", type=int, default=20, help="steps of the fp32 and bf16 runs (default 20)")
    ap.add_argument("--fp16-steps", type=int, default=None, help="steps of the two fp16 runs (default: --steps on CUDA, 3 on CPU)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per row (default 32 on CPU; use 128+ on a GPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches, cycled (default 4)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--init-scale", type=float, default=2.0 ** 16, help="GradScaler's initial loss scale (torch default 65536)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(RESULTS / "finetune_curves"), help="path stem for .json and .png")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        png = Path(args.replot).with_suffix(".png")
        plot(data["runs"], png, _title(data))
        log(f"wrote {png}")
        return 0
    fp16_steps = args.fp16_steps if args.fp16_steps is not None else (args.steps if args.device == "cuda" else 3)

    log(f"loading {args.model}")
    original, distinct = load(args.model, args.seq_len, args.batches, args.batch)
    original.to(args.device)
    batches = [distinct[i % len(distinct)] for i in range(args.steps)]
    results: dict = {}
    runs: dict[str, dict] = {}

    def record(label: str, run, extra: dict | None = None) -> None:
        runs[label] = {**run.to_dict(), **(extra or {})}
        sec = run.seconds[1:] or run.seconds  # the first step pays one-off costs
        log(f"{label}: losses {[round(x, 4) for x in run.losses]}, {sum(sec) / len(sec):.2f} s/step, "
            f"{sum(run.skipped)} skipped")

    for label, precision, n in (("fp32", "fp32", args.steps), ("bf16", "bf16", args.steps), ("fp16 original", "fp16", fp16_steps)):
        log(f"{label}: {n} steps")
        model = copy.deepcopy(original)
        record(label, train_steps(model, batches[:n], precision, lr=args.lr, init_scale=args.init_scale,
                                  on_step=lambda i, r: log(f"  {label} step {i + 1}: loss {r.losses[-1]:.4f} ({r.seconds[-1]:.1f} s)")))
        del model

    log("converting (halfsafe.make_fp16_safe, calibration = the training rows)")
    converted = copy.deepcopy(original)
    t = time.perf_counter()
    report = make_fp16_safe(converted, [r[:1] for r in distinct], candidates=1, progress=False)
    results["conversion"] = {"plan": report.plan.exponents, "seconds": time.perf_counter() - t,
                             "fp32_output_change": report.fp32_output_change, "unfixable": report.unfixable[:5]}
    log(f"plan {report.plan.exponents} ({results['conversion']['seconds']:.0f} s)")
    log(f"fp16 halfsafe: {fp16_steps} steps")
    record("fp16 halfsafe", train_steps(converted, batches[:fp16_steps], "fp16", lr=args.lr, keep_coordinates=report.plan,
                                        init_scale=args.init_scale,
                                        on_step=lambda i, r: log(f"  fp16 halfsafe step {i + 1}: loss {r.losses[-1]:.4f} ({r.seconds[-1]:.1f} s)")))

    ref = runs["fp32"]["losses"]
    summary = {}
    for label, r in runs.items():
        sec = r["seconds"][1:] or r["seconds"]
        summary[label] = {
            "steps": len(r["losses"]), "finite": all(math.isfinite(x) for x in r["losses"]), "skipped": sum(r["skipped"]),
            "first_update_step": next((i + 1 for i, s in enumerate(r["skipped"]) if not s), None),
            "final_loss_scale": r["loss_scale"][-1] if r["loss_scale"] else None,
            "first_loss": r["losses"][0], "last_loss": r["losses"][-1], "max_rel_dev_from_fp32": rel_dev(r["losses"], ref),
            "seconds_per_step": sum(sec) / len(sec),
        }
    results.update({
        "model": args.model, "device": args.device, "steps": args.steps, "fp16_steps": fp16_steps, "seq_len": args.seq_len,
        "batch": args.batch, "distinct_batches": len(distinct), "lr": args.lr, "init_scale": args.init_scale, "optimizer": "AdamW(weight_decay=0), clip 1.0",
        "summary": summary, "runs": runs,
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                        "processor": platform.processor(), "threads": torch.get_num_threads(),
                        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "command": " ".join(["python", "bench/training/finetune_curves.py", *map(shlex.quote, sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    })
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")
    plot(runs, out.with_suffix(".png"), _title(results))
    for label, s in summary.items():
        log(f"{label:>14}: steps {s['steps']:>2}, finite {s['finite']}, skipped {s['skipped']} (first update at step "
            f"{s['first_update_step']}), loss {s['first_loss']:.4f} -> "
            f"{s['last_loss']:.4f}, max rel dev from fp32 {s['max_rel_dev_from_fp32']:.2e}, {s['seconds_per_step']:.2f} s/step")
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
