"""The `halfsafe` command: a thin layer over the Python API.

Top level: the one entry point, above every floor.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.text import Text

from . import requests as rq
from ._version import __version__
from .errors import HalfsafeError
from .requests import DEFAULT_MAX_SHARD_SIZE, DEFAULT_MODEL

console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


class _Parser(argparse.ArgumentParser):
    """A usage error in one line (exit 2) that names the option and points at --help."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _count(least: int):
    """An argparse type: an integer >= `least`, refused at parse time."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is too small: use at least {least}")
        return value
    parse.__name__ = "count"
    return parse


def _number(text: str) -> float:
    """An argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _shard_size(text: str) -> int:
    from .io.checkpoint import shard_size

    try:
        return shard_size(text)
    except HalfsafeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give e.g. 5GB, 500MB or a number of bytes") from None


def _device(text: str) -> str:
    from .engine.device import DEVICES

    if text in DEVICES or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use one of {', '.join(DEVICES)} (or cuda:N)")


def _add_text_args(p: argparse.ArgumentParser, defaults: rq.TextOptions) -> None:
    """--text, --seq-len and --max-samples, with the command's request's defaults (halfsafe.requests)."""
    p.add_argument("--text", action="append", metavar="FILE", help="calibration text file (repeatable; default: the embedded text)")
    p.add_argument("--seq-len", type=_count(2), default=defaults.seq_len, help=f"tokens per sample (default {defaults.seq_len})")
    p.add_argument("--max-samples", type=_count(1), default=defaults.max_samples, help=f"samples at most (default {defaults.max_samples})")


def _text(args) -> rq.TextOptions:
    """--text (each file checked here, before anything loads; none: the command's embedded text), --seq-len,
    --max-samples and --tokenizer."""
    from .calibration import read_texts

    return rq.TextOptions(read_texts(args.text) if args.text else None, args.seq_len, args.max_samples,
                          getattr(args, "tokenizer", None))


def _engine(args) -> rq.EngineOptions:
    return rq.EngineOptions(stream=not args.whole, device=args.device)


def _say(text: str) -> None:
    """A line that names a user's path, printed as it is: no Rich markup or emoji codes read in it, never wrapped."""
    console.print(text, markup=False, emoji=False, soft_wrap=True)


def _write_json(path: str | None, data: dict) -> None:
    """The report, written whole or not at all (halfsafe.io.paths.write_file)."""
    from .io.paths import write_file

    if path:
        text = json.dumps(data, indent=2, allow_nan=True) + "\n"
        write_file(path, lambda tmp: tmp.write_text(text), "--json")
        _say(f"wrote {path}")


def _split_k(text: str):
    """An argparse type: --split-k's rule (runtime.profiles.SplitK.parse), refused at parse time."""
    from .runtime.profiles import SplitK

    try:
        return SplitK.parse(text)
    except HalfsafeError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--split-k {text!r:.60}: ")) from None


def _split_k_option(p, what: str) -> None:
    from .runtime.profiles import PROFILES

    p.add_argument("--split-k", type=_split_k, metavar="RULE", help=(
        f"{what}how the ONNX graph's matrix products are cut along K, for float16 runtimes whose MatMul keeps one "
        "float16 running sum (ONNX Runtime's WebGPU provider: transformers.js with device 'webgpu', dtype 'fp16'): "
        "none (the plain graph), terms:N (each product's K in the fewest groups of at most N terms), terms:L,H,A (a "
        "bound each for the linear layers, the head and attention's QK^T) or L,H,A (groups "
        f"for the linear layers, the head and attention's QK^T); default: the ort-webgpu profile's, "
        f"{PROFILES['ort-webgpu'].split_k.label} (a provider that sums in float32 computes the split and the plain graph alike)"))


def _runtime_option(p, what: str) -> None:
    from .runtime.profiles import DEFAULT, PROFILES

    p.add_argument("--runtime", default=DEFAULT, choices=tuple(PROFILES), metavar="P",
                   help=f"{what} under runtime profile P's float16 arithmetic ({', '.join(PROFILES)}; default {DEFAULT})")


def _fp16_arith_option(p, what: str) -> None:
    p.add_argument("--fp16-arith", default=rq.DEFAULT_FP16_ARITH, choices=rq.FP16_ARITHS,
                   help=f"how {what} computes: emulated (float16 matrix products from float32 kernels, rounded once), "
                        "native (PyTorch's float16 kernels) or auto (default: emulated where proven and where PyTorch's "
                        "float16 products are slow)")


def _device_option(p, what: str = "one block on it at a time", default: str = "auto") -> None:
    p.add_argument("--device", default=default, type=_device, help=f"cpu, cuda or auto (default: cuda when torch sees a GPU): {what}")


def _tokenizer_option(p) -> None:
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="take the tokenizer from FOLDER (checked as MODEL is) instead of MODEL's own: for a GGUF without "
                        "one, or a model whose tokenizer files are broken (default: MODEL's own; none: text as byte ids)")


def _engine_options(p) -> None:
    _device_option(p, default=rq.EngineOptions().device)
    p.add_argument("--whole", action="store_true",
                   help="load the whole model into memory instead of one block at a time from its shards (faster for small models)")


def scan_request(args) -> rq.ScanRequest:
    return rq.ScanRequest(args.model, _text(args), rq.ScanOptions.checked(args.fp16_check, args.runtime, args.fp16_arith),
                          _engine(args))


def cmd_scan(args) -> int:
    from .display import scan_tables
    from .plots import plot_layer_peaks
    from .scan import run_scan

    report = run_scan(scan_request(args))
    scan_tables(report, console, top=args.top)
    _write_json(args.json, report.to_dict())
    if args.plot:
        written = plot_layer_peaks({"float32 run": [l.residual_peak for l in report.layers]}, args.plot,
                                   f"{args.model}: residual peak per layer")
        _say(f"wrote {written}")
    return 0


def convert_request(args) -> rq.ConvertRequest:
    return rq.ConvertRequest(
        args.model, args.out, _text(args),
        rq.PlanOptions.checked(args.headroom_bits, args.max_context, args.allow_unfixable, runtime=args.runtime,
                               fp16_arith=args.fp16_arith, calib_arith=args.calib_arith),
        long_sample=args.long_sample, overwrite=args.overwrite, engine=_engine(args), max_shard_size=args.max_shard_size,
        to=args.to, split_k=args.split_k,
    )


def cmd_convert(args) -> int:
    from .convert import run_convert
    from .display import conversion_tables
    from .plots import plot_layer_peaks

    request = convert_request(args)
    exported, exported_gguf, finish = [], [], None
    if request.to == "onnx":
        from .export.onnx import add_onnx, check_folder_exportable, require_onnx
        from .progress import phase

        require_onnx()  # fail before the slow part
        check_folder_exportable(request.source)

        def finish(folder: Path) -> None:  # into the checkpoint's temporary folder, before it becomes OUT
            with phase("export"):  # recorded with the conversion's phases, after the write
                exported.append(add_onnx(folder, runtime=request.export_runtime, final=request.out, split_k=request.split_k))
    elif request.to == "gguf":
        from .export.gguf import add_gguf, check_gguf_target
        from .progress import phase

        llama_cpp = check_gguf_target(request.source)  # fail before the slow part

        def finish(folder: Path) -> None:  # into the checkpoint's temporary folder, before it becomes OUT
            with phase("export"):
                gguf = add_gguf(folder, llama_cpp, final=request.out)
            exported_gguf.append(gguf)

    report = run_convert(request, finish)
    conversion_tables(report, console)
    _say(f"wrote {args.out} (fp16 checkpoint, halfsafe.json, README.md)")  # OUT is in place, the ONNX inside it
    for gguf in exported_gguf:
        _say(f"wrote {gguf.path} (F16 GGUF by llama.cpp's converter, {gguf.tensors} tensors exact)")
    for onnx_report in exported:
        shifts = [p["shift"] for p in onnx_report.norm_prescales.values()]
        _say(f"wrote {onnx_report.path} (fp16 ONNX" + (f"; --runtime {request.export_runtime.name}: {len(shifts)} norms prescaled by "
             f"2^-{min(shifts)} .. 2^-{max(shifts)} inside the norm" if shifts else "") + ")")
    _write_json(args.json, {"source": args.model, **report.to_dict(), "phases": report.phases})
    if args.plot:
        written = plot_layer_peaks(
            {"before": [l.residual_peak for l in report.scan_before.layers], "after (fp16 checkpoint)": [v for _, v in report.layers_after]},
            args.plot, f"{args.model}: residual peak per layer, before and after",
        )
        _say(f"wrote {written}")
    return 0


def apply_request(args) -> rq.ApplyRequest:
    return rq.ApplyRequest(args.plan, args.model, args.out, _text(args), overwrite=args.overwrite, engine=_engine(args))


def cmd_apply(args) -> int:
    from .convert import run_apply

    plan, after = run_apply(apply_request(args))
    peak = after.peak  # apply_checkpoint refuses (and writes nothing) when the result is not fp16-safe
    _say(f"applied {len(plan.tensors)} tensor rescales ({plan.family}) and wrote {args.out}")
    kept = "keeps" if peak.headroom_bits >= plan.headroom_bits else "does NOT keep"
    console.print(f"fp16-safe on the check text: peak {peak.abs_max:.4g} at {peak.name}, {peak.headroom_bits:.2f} bits "
                  f"under 65504 ({kept} the plan's {plan.headroom_bits:.2f}-bit margin)")
    return 0


def cmd_demo(args) -> int:
    """scan -> convert -> verify on the built-in Gemma 3 270M, each step's table printed."""
    from .calibration import default_text, make_samples
    from .convert import convert_checkpoint
    from .display import conversion_tables, scan_tables, verify_tables
    from .io.builtin import cache_dir
    from .io.loading import load_model
    from .scan import scan
    from .verify import verify

    out = Path(args.out) if args.out else cache_dir() / "demo" / f"{DEFAULT_MODEL}-fp16"
    console.rule(f"1/3  halfsafe scan {DEFAULT_MODEL}")
    loaded = load_model(DEFAULT_MODEL, stream=True)
    samples = make_samples([default_text()], loaded.tokenizer, loaded.model.config.get_text_config().vocab_size,
                           rq.SCAN_TEXT.seq_len, rq.SCAN_TEXT.max_samples)
    scan_tables(scan(loaded.model, samples, fp16_check=True, name=DEFAULT_MODEL), console, top=6)
    del loaded
    console.rule(Text(f"2/3  halfsafe convert {DEFAULT_MODEL} {out}"))  # a Text: the path as it is
    conversion_tables(convert_checkpoint(DEFAULT_MODEL, str(out), overwrite=True), console)
    _say(f"wrote {out}")
    console.rule(Text(f"3/3  halfsafe verify {DEFAULT_MODEL} {out}"))
    report = verify(DEFAULT_MODEL, str(out), seq_len=args.seq_len, max_samples=args.max_samples, greedy_tokens=args.greedy_tokens)
    verify_tables(report, console)
    return 0


def cmd_formats(args) -> int:
    from .core.formats import DTYPES, all_formats, product_in, round_to, spacing_near
    from .display import formats_table

    formats_table(all_formats(), console)
    if args.value is not None:
        for name in DTYPES:
            stored = round_to(args.value, name)
            line = f"{name:>9}: {args.value:g} is stored as {stored:.10g} (spacing there {spacing_near(args.value, name):.3g})"
            if args.times is not None:
                line += f"; x {args.times:g} = {product_in(args.value, args.times, name):.10g}"
            console.print(line)
    return 0


def finetune_request(args) -> rq.FinetuneRequest:
    config = rq.FinetuneConfig(steps=args.steps, threshold=args.threshold, margin_bits=args.margin_bits, lr=args.lr,
                               penalty_weight=args.penalty_weight, polish_steps=args.polish_steps, train=args.train,
                               save_every=args.save_every, headroom_bits=args.headroom_bits)
    return rq.FinetuneRequest(args.model, args.out, _text(args), config, overwrite=args.overwrite, restart=args.restart,
                              resume_from=args.resume_from, save_unconverged=args.save_unconverged, device=args.device)


def cmd_finetune(args) -> int:
    from .training.finetune import run_finetune

    report, conversion, fp16 = run_finetune(finetune_request(args))  # bad numbers fail before loading anything
    res = conversion.plan.exponents.get("residual")
    console.print(f"exact rescale first: {len(conversion.plan.tensors)} tensors" + (f", residual x 2^{res}" if res else ""))
    if report.resumed_from_step is not None:
        console.print(f"resumed from step {report.resumed_from_step}")
    for site in report.watched:
        console.print(f"  {site}: |x| max {report.peaks_before.get(site, float('nan')):.4g} -> {report.peaks_after.get(site, float('nan')):.4g}")
    console.print(f"{report.steps} steps; {report.stop_reason}; mean KL to the original {report.kl:.2e} nats/token")
    console.print(f"float16 check: finite = {fp16['finite']}, largest |x| {fp16['peak']:.4g} at {fp16['peak_site']}")
    _say(f"wrote {args.out} (fp16 checkpoint, halfsafe.json, README.md)")
    _write_json(args.json, {"finetune": report.to_dict(), "conversion": conversion.to_dict(), "fp16_check": fp16})
    return 0


def verify_request(args) -> rq.VerifyRequest:
    return rq.VerifyRequest(  # texts: the embedded held-out text unless --text; --max-samples 0: the whole text
        args.model, args.converted, replace(_text(args), max_samples=args.max_samples or None),
        text_names=[Path(t).name for t in args.text] if args.text else None, greedy_tokens=args.greedy_tokens,
        engine=_engine(args), fp16=rq.Fp16Options.checked(args.runtime, args.fp16_arith),
    )


def cmd_verify(args) -> int:
    from .display import verify_tables
    from .verify import write_plots
    from .verify.compare import run_verify

    report = run_verify(verify_request(args))  # progress: halfsafe.progress, per phase
    verify_tables(report, console)
    _write_json(args.json, report.to_dict())
    if args.plot:
        for path in write_plots(report, args.plot):
            _say(f"wrote {path}")
    return 0


def export_request(args) -> rq.ExportRequest:
    return rq.ExportRequest(args.converted, args.out, args.format, overwrite=args.overwrite, scan=args.scan,
                            runtime=rq.runtime_profile(args.runtime), llama_cpp=args.llama_cpp, split_k=args.split_k)


def cmd_export(args) -> int:
    from .export.onnx import run_export
    from .progress import phase

    request = export_request(args)
    if request.format == "gguf":
        from .export.gguf import export_gguf

        with phase("export"):
            gguf = export_gguf(request.converted, request.out, request.llama_cpp, overwrite=request.overwrite)
        _say(f"wrote {gguf.path} (F16 GGUF by llama.cpp's converter, {gguf.file_bytes / 2**20:,.1f} MiB, {gguf.tensors} tensors exact)")
        _write_json(args.json, gguf.to_dict())
        return 0
    with phase("export"):  # warns if not converted
        report = run_export(request)
    _say(f"wrote {report.path} (fp16 ONNX, {report.file_bytes / 2**20:,.1f} MiB, {report.clip_nodes} Clip nodes)")
    if report.norm_prescales:
        shifts = [p["shift"] for p in report.norm_prescales.values()]
        console.print(f"--runtime {report.runtime}: {len(shifts)} norms prescaled by 2^-{min(shifts)} .. 2^-{max(shifts)} inside the norm")
    _write_json(args.json, report.to_dict())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="halfsafe", description="Make bf16-pretrained models fp16-safe by exact power-of-two rescaling.")
    parser.add_argument("--version", action="version", version=f"halfsafe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scan", help="measure where a model would overflow float16")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model folder, .gguf file, cached hub id, or {DEFAULT_MODEL!r} (default)")
    _add_text_args(p, rq.SCAN_TEXT)
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of per-layer peaks against the fp16 limit (PATH's suffix names "
                   "the format, e.g. .pdf or .svg; none: PATH.png)")
    p.add_argument("--fp16-check", action="store_true", help="also run in fp16 and name the first module that turns non-finite")
    p.add_argument("--top", type=_count(1), default=rq.TOP, help="rows in the tightest-tensors table")
    _runtime_option(p, "also measure what would overflow")
    _fp16_arith_option(p, "--fp16-check")
    _engine_options(p)
    _tokenizer_option(p)
    p.set_defaults(func=cmd_scan)

    p = sub.add_parser("convert", help="rescale a model exactly so it runs in float16; save an fp16 checkpoint")
    p.add_argument("model", help=f"model folder, .gguf file, cached hub id, or {DEFAULT_MODEL!r}")
    p.add_argument("out", help="output folder (must not exist unless --overwrite)")
    _add_text_args(p, rq.CONVERT_TEXT)
    p.add_argument("--max-context", type=_count(1), metavar="N", help="make the margin for contexts up to N tokens (default: the model's longest)")
    p.add_argument("--headroom-bits", type=_number, help="keep every movable activation this many bits under 65504 (default: the margin for --max-context)")
    p.add_argument("--long-sample", type=_count(2), metavar="N", help="also calibrate on one N-token sample (the embedded text repeated)")
    p.add_argument("--allow-unfixable", action="store_true", help="save even if some activation no exact rescaling reaches still overflows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that halfsafe wrote (its halfsafe.json is a record, and it holds only the files that lists, each with the bytes it lists) or an empty one")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of per-layer peaks before and after")
    p.add_argument("--to", choices=rq.TARGETS, help="also write an fp16 ONNX model into OUT/onnx/ (as `halfsafe export onnx`), "
                   "or an F16 GGUF, OUT/model-f16.gguf (as `halfsafe export gguf`)")
    _split_k_option(p, "--to onnx: ")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON: halfsafe.json's content and the time each phase took")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, type=_shard_size,
                   help=f"largest output weight file, e.g. 2GB (default {DEFAULT_MAX_SHARD_SIZE}, as the hub expects; bigger "
                        "checkpoints get model-0000N-of-0000M.safetensors and model.safetensors.index.json)")
    _runtime_option(p, "choose the plan (or refuse)")
    _fp16_arith_option(p, "the candidates' float16 trial")
    p.add_argument("--calib-arith", default=rq.DEFAULT_CALIB_ARITH, choices=rq.CALIB_ARITHS,
                   help="how the calibration's matrix products compute: float32, bfloat16 (operands rounded to bfloat16, "
                        "the plan kept as float32's: calibrated again in float32 where a peak sits too near a limit) or "
                        "auto (default: bfloat16 where this CPU multiplies bfloat16 faster than float32)")
    _engine_options(p)
    _tokenizer_option(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="export a converted checkpoint to another runtime's format (fp16 ONNX, F16 GGUF)")
    p.add_argument("format", choices=rq.FORMATS, help="onnx: fp16 ONNX for ONNX Runtime / transformers.js (onnx/model_fp16.onnx); "
                   "gguf: an F16 GGUF file for llama.cpp, written by llama.cpp's own converter, every tensor exact")
    p.add_argument("converted", help="the folder `halfsafe convert` wrote")
    p.add_argument("out", help="output folder (a .gguf file for gguf; must not exist unless --overwrite)")
    p.add_argument("--llama-cpp", metavar="DIR", help="gguf: the llama.cpp checkout whose convert_hf_to_gguf.py runs "
                   "(default: $HALFSAFE_LLAMA_CPP_DIR, else the one scripts/setup-llama-cpp made)")
    p.add_argument("--scan", action="store_true", help="if CONVERTED was not converted by halfsafe, scan it briefly and say what it overflows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that halfsafe wrote (its halfsafe.json is a record, and it holds only the files that lists, each with the bytes it lists) or an empty one; for gguf, a GGUF file")
    p.add_argument("--json", metavar="PATH", help="write what was exported (I/O names, Clip nodes, weight dtypes, sizes) as JSON")
    _runtime_option(p, "compute the norms (prescaled inside each norm) to run")
    _split_k_option(p, "onnx: ")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("apply", help="re-apply a saved plan to another checkpoint of the same architecture (e.g. a fine-tune)")
    p.add_argument("plan", help="plan.json, a converted folder's halfsafe.json, or the converted folder")
    p.add_argument("model", help="model folder (same architecture and sizes as the plan's)")
    _engine_options(p)
    p.add_argument("out", help="output folder (must not exist unless --overwrite)")
    _add_text_args(p, rq.APPLY_TEXT)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that halfsafe wrote (its halfsafe.json is a record, and it holds only the files that lists, each with the bytes it lists) or an empty one")
    _tokenizer_option(p)
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("demo", help=f"scan, convert and verify the built-in {DEFAULT_MODEL} and print the tables")
    p.add_argument("--out", help="where to write the converted checkpoint (default: in the halfsafe cache; replaced)")
    p.add_argument("--seq-len", type=_count(2), default=rq.VERIFY_TEXT.seq_len,
                   help=f"verify: tokens per held-out sample (default {rq.VERIFY_TEXT.seq_len})")
    p.add_argument("--max-samples", type=_count(1), default=rq.VERIFY_TEXT.max_samples,
                   help=f"verify: held-out samples (default {rq.VERIFY_TEXT.max_samples})")
    p.add_argument("--greedy-tokens", type=_count(0), default=rq.GREEDY_TOKENS,
                   help=f"verify: greedy tokens compared with fp32 (default {rq.GREEDY_TOKENS})")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("formats", help="bf16 / fp16 / fp32 side by side")
    p.add_argument("--value", type=_number, help="show how this value is stored in each format")
    p.add_argument("--times", type=_number, help="with --value: the product value * times computed in each format")
    p.set_defaults(func=cmd_formats)

    p = sub.add_parser("finetune", help="where no exact rescale reaches: fine-tune peaks below a threshold (KL to the original); save fp16")
    p.add_argument("model", help=f"model folder, .gguf file, cached hub id, or {DEFAULT_MODEL!r}")
    p.add_argument("out", help="output folder (must not exist unless --overwrite); unfinished state is kept in .OUT.partial beside it")
    _add_text_args(p, rq.FINETUNE_TEXT)
    ft = rq.FinetuneConfig()  # the defaults
    p.add_argument("--steps", type=_count(0), default=ft.steps, help=f"optimizer steps at most (default {ft.steps}); a rerun with more continues")
    p.add_argument("--threshold", type=_number, default=ft.threshold,
                   help=f"every activation must end below this |x| (default {ft.threshold:g}: 2 bits under 65504)")
    p.add_argument("--margin-bits", type=_number, default=ft.margin_bits,
                   help=f"stop once watched peaks are this many bits under the threshold (default {ft.margin_bits:g})")
    p.add_argument("--lr", type=_number, default=ft.lr, help=f"relative step: each tensor moves by about lr x its RMS (default {ft.lr:g})")
    p.add_argument("--penalty-weight", type=_number, default=ft.penalty_weight,
                   help=f"weight of the hinge penalty against the KL term (default {ft.penalty_weight:g})")
    p.add_argument("--polish-steps", type=_count(0), default=ft.polish_steps,
                   help=f"steps after the peaks first meet the target, for the KL to recover (default {ft.polish_steps})")
    p.add_argument("--train", choices=rq.TRAIN_MODES, default=ft.train,
                   help="what trains: the module around each watched site (default: a gate's MLP), its whole block, or all")
    p.add_argument("--headroom-bits", type=_number, default=ft.headroom_bits,
                   help=f"headroom of the exact rescale that runs first (default {ft.headroom_bits:g})")
    p.add_argument("--save-every", type=_count(1), default=ft.save_every, help=f"steps between training-state saves (default {ft.save_every})")
    p.add_argument("--resume-from", metavar="STATE", help="resume from this state file instead of OUT's partial folder")
    p.add_argument("--restart", action="store_true", help="discard a saved training state and start over")
    p.add_argument("--save-unconverged", action="store_true", help="save even if --steps ran out before every peak was below the target")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that halfsafe wrote (its halfsafe.json is a record, and it holds only the files that lists, each with the bytes it lists) or an empty one")
    p.add_argument("--json", metavar="PATH", help="write the fine-tune and conversion report as JSON")
    _device_option(p, "where the whole model trains")
    _tokenizer_option(p)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("verify", help="compare fp32, bf16, fp16, fp16 baselines and a converted checkpoint on held-out text")
    p.add_argument("model", help=f"the original: model folder, .gguf file, cached hub id, or {DEFAULT_MODEL!r}")
    p.add_argument("converted", nargs="?", help="the fp16 checkpoint `halfsafe convert` wrote from MODEL (optional)")
    p.add_argument("--text", action="append", metavar="FILE", help="text file to measure on (repeatable; default: the embedded held-out text)")
    p.add_argument("--seq-len", type=_count(2), default=rq.VERIFY_TEXT.seq_len, help=f"tokens per sample (default {rq.VERIFY_TEXT.seq_len})")
    p.add_argument("--max-samples", type=_count(0), default=rq.VERIFY_TEXT.max_samples,
                   help=f"samples per text at most (default {rq.VERIFY_TEXT.max_samples}; 0: the whole text)")
    p.add_argument("--greedy-tokens", type=_count(0), default=rq.GREEDY_TOKENS,
                   help=f"greedy tokens generated from the start of each text (default {rq.GREEDY_TOKENS}; 0: none)")
    p.add_argument("--json", metavar="PATH", help="write every metric, per variant and per text, as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of KL per variant, and PATH-layers.png of per-layer peaks before/after")
    _runtime_option(p, "also run fp16 and the converted checkpoint")
    _fp16_arith_option(p, "every float16 variant")
    _engine_options(p)
    _tokenizer_option(p)
    p.set_defaults(func=cmd_verify)
    return parser


_READS = (("model", "the model"), ("converted", "the converted folder"), ("tokenizer", "the tokenizer"))  # by input_paths
_READ_FILES = (("text", "the text file"), ("plan", "the plan"), ("resume_from", "the training state"))  # a file; a plan
# may be a converted folder too (a folder given as a text or a state is refused as what it is by its own check, later)


def _check_paths(args) -> None:
    """Every path the command writes (OUT, --json, --plot) against every path it reads (MODEL and each of its files,
    CONVERTED, --tokenizer, each --text, the plan, --resume-from) and against each other, right after parsing (before
    anything loads), in one check (halfsafe.io.paths.check_writes): none may be, hold, lie in, lead to or be a hard
    link to another; a report is a file whose names fit the file system and whose folder can be made; --plot in a
    format matplotlib writes here (halfsafe.plots.plot_file)."""
    from .io.loading import input_paths
    from .io.paths import check_writes

    reads = [(label, p) for name, label in _READS if getattr(args, name, None) for p in input_paths(getattr(args, name))]
    for name, label in _READ_FILES:
        given = getattr(args, name, None)
        reads += [(label, Path(p)) for p in (given if isinstance(given, list) else [given] if given else [])
                  if name == "plan" or not os.path.isdir(p)]
    if args.command == "demo":
        reads += [("the model", p) for p in input_paths(DEFAULT_MODEL)]
    file_out = args.command == "export" and args.format == "gguf"  # OUT.gguf: a file
    writes = [("OUT" if file_out else "output folder", Path(args.out), not file_out)] if getattr(args, "out", None) else []
    writes += [("--json", Path(args.json), False)] if getattr(args, "json", None) else []
    if getattr(args, "plot", None):
        if args.command == "verify":
            from .verify.plots import plot_files

            writes += [("--plot", p, False) for p in plot_files(args.plot)]
        else:
            from .plots import plot_file

            writes.append(("--plot", plot_file(args.plot)[0], False))
    check_writes(writes, reads)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a usage error (exit 2, one line), --help or --version: the code, as for every other exit
        return e.code if isinstance(e.code, int) else 2

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub at run time
    from . import progress

    try:
        _check_paths(args)
        progress.show()  # on stderr: a bar on a terminal, a plain line every few seconds in a file or a CI log
        return args.func(args)
    except HalfsafeError as e:
        line = re.sub(r"\s*[\r\n]\s*", " ", str(e)).strip()  # one line; a path's own spaces kept as they are
        err_console.print(Text.assemble(("error:", "red"), f" {line}"), highlight=False, soft_wrap=True)  # a Text: no markup read
        return 2
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    finally:
        progress.hide()


if __name__ == "__main__":
    sys.exit(main())
