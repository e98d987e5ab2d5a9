"""The `halfsafe` command: a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rich.console import Console

from . import __version__
from .errors import HalfsafeError

DEFAULT_MODEL = "gemma3-270m"
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _add_text_args(p: argparse.ArgumentParser, seq_len: int = 512, max_samples: int | None = 8) -> None:
    p.add_argument("--text", action="append", metavar="FILE", help="calibration text file (repeatable; default: the embedded text)")
    p.add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per sample (default {seq_len})")
    p.add_argument("--max-samples", type=int, default=max_samples, help=f"samples at most (default {max_samples})")


def _samples(args, loaded):
    from .calibration import make_samples, read_texts

    texts = read_texts(args.text)
    return make_samples(texts, loaded.tokenizer, loaded.model.config.get_text_config().vocab_size, args.seq_len, args.max_samples)


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
        console.print(f"wrote {path}")


def cmd_scan(args) -> int:
    from .display import scan_tables
    from .loading import load_model
    from .plots import plot_layer_peaks
    from .scan import scan

    loaded = load_model(args.model)
    report = scan(loaded.model, _samples(args, loaded), fp16_check=args.fp16_check, name=args.model)
    scan_tables(report, console, top=args.top)
    _write_json(args.json, report.to_dict())
    if args.plot:
        plot_layer_peaks({"float32 run": [l.residual_peak for l in report.layers]}, args.plot, f"{args.model}: residual peak per layer")
        console.print(f"wrote {args.plot}")
    return 0


def cmd_convert(args) -> int:
    from .calibration import read_texts
    from .convert import convert_checkpoint
    from .display import conversion_tables
    from .plots import plot_layer_peaks

    report = convert_checkpoint(
        args.model, args.out, texts=read_texts(args.text), seq_len=args.seq_len, max_samples=args.max_samples,
        headroom_bits=args.headroom_bits, allow_unfixable=args.allow_unfixable, overwrite=args.overwrite,
    )
    conversion_tables(report, console)
    console.print(f"wrote {args.out} (fp16 checkpoint, halfsafe.json, README.md)")
    if args.plot:
        plot_layer_peaks(
            {"before": [l.residual_peak for l in report.scan_before.layers], "after (fp16 checkpoint)": [v for _, v in report.layers_after]},
            args.plot, f"{args.model}: residual peak per layer, before and after",
        )
        console.print(f"wrote {args.plot}")
    return 0


def cmd_formats(args) -> int:
    from .display import formats_table
    from .formats import DTYPES, all_formats, product_in, round_to, spacing_near

    formats_table(all_formats(), console)
    if args.value is not None:
        for name in DTYPES:
            stored = round_to(args.value, name)
            line = f"{name:>9}: {args.value:g} is stored as {stored:.10g} (spacing there {spacing_near(args.value, name):.3g})"
            if args.times is not None:
                line += f"; x {args.times:g} = {product_in(args.value, args.times, name):.10g}"
            console.print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfsafe", description="Make bf16-pretrained models fp16-safe by exact power-of-two rescaling.")
    parser.add_argument("--version", action="version", version=f"halfsafe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scan", help="measure where a model would overflow float16")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model folder, .gguf file, cached hub id, or {DEFAULT_MODEL!r} (default)")
    _add_text_args(p)
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of per-layer peaks against the fp16 limit")
    p.add_argument("--fp16-check", action="store_true", help="also run in fp16 and name the first module that turns non-finite")
    p.add_argument("--top", type=int, default=12, help="rows in the tightest-tensors table")
    p.set_defaults(func=cmd_scan)

    p = sub.add_parser("convert", help="rescale a model exactly so it runs in float16; save an fp16 checkpoint")
    p.add_argument("model", help=f"model folder, .gguf file, cached hub id, or {DEFAULT_MODEL!r}")
    p.add_argument("out", help="output folder (must not exist unless --overwrite)")
    _add_text_args(p)
    p.add_argument("--headroom-bits", type=float, default=2.0, help="keep every movable activation this many bits under 65504 (default 2)")
    p.add_argument("--allow-unfixable", action="store_true", help="save even if some activation no exact rescaling reaches still overflows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of per-layer peaks before and after")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("formats", help="bf16 / fp16 / fp32 side by side")
    p.add_argument("--value", type=float, help="show how this value is stored in each format")
    p.add_argument("--times", type=float, help="with --value: the product value * times computed in each format")
    p.set_defaults(func=cmd_formats)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub at run time
    try:
        return args.func(args)
    except HalfsafeError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
