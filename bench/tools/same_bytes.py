#!/usr/bin/env python
"""Do two versions of halfsafe write the same bytes? A change to how halfsafe is built must leave what it writes as
it was: the converted safetensors, config.json, halfsafe.json and the model card.

Every tiny family (tests/tiny) is made to overflow float16 in its activations (tests/stress.py) and saved once, with
a README.md of its own (the card is appended to it) and a nudged copy (a "fine-tune" of it). Each version then, in a
process of its own (two versions of one package cannot share a process), runs on every model:
`halfsafe convert` (streamed), `convert --whole`, `halfsafe apply` of the converted folder's plan to the nudged copy,
and, on a few families, `halfsafe finetune` (a few steps, saved unconverged: the fine-tune card section is written),
`convert --runtime` under two runtime profiles (all-fp16, ort-webgpu), `convert --to onnx`, `export onnx` of the
converted folder and `export onnx --runtime ort-webgpu` (the graph's split products and prescaled norms).
Every file each version wrote is compared byte for byte; a command that fails on one side and not the other is a
difference too.

    python bench/tools/same_bytes.py --base HEAD~3                       # a commit of this repository
    python bench/tools/same_bytes.py --base /work/main/src               # a folder holding the package
    python bench/tools/same_bytes.py --base HEAD~3 --families gemma3_text t5 bart

`--new` (default: this checkout's src) is the version under test. Exit status 0 when every file is the same, 1 when
any differs. About 15 s per family and version on 2 cores (the imports are paid once per version; a fine-tune ~30 s).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import ROOT, add_paths  # noqa: E402

WRITES = ()  # prints only: nothing in bench/results/ (python bench/list.py)

ARGS = ["--seq-len", "32", "--max-samples", "2"]
FINETUNE_FAMILIES = ("llama", "gemma3_text")  # training is slow: a decoder with plain and with (1+w) norm gains
FINETUNE = ["finetune", *ARGS, "--steps", "2", "--threshold", "64", "--save-unconverged"]
# --runtime and ONNX: a decoder with plain and with (1+w) norm gains, an encoder and an encoder-decoder (an export
# takes ~10 s a family; a family the exporter refuses is compared by its exit status)
RUNTIME_FAMILIES = ("llama", "gemma3_text", "gpt2", "t5")
ONNX_FAMILIES = ("llama", "gemma3_text", "bert", "t5")


def build_models(folder: Path, keys: list[str]) -> list[str]:
    """Every family in `keys` stressed and saved as `folder/KEY/base` (with a README.md) and `folder/KEY/nudged`;
    returns the keys built (a family the stress table cannot make overflow is skipped, said on stderr)."""
    add_paths("tests", "src")
    import torch
    from stress import make_stress
    from tiny import make_tiny

    from halfsafe.calibration import default_text, make_samples
    from halfsafe.core.forward import logits

    built = []
    for key in keys:
        model = make_tiny(key)
        calib = make_samples([default_text()], None, model.config.get_text_config().vocab_size, 32, 2)
        try:
            make_stress(model, lambda: [logits(model, ids) for ids in calib])
        except (AssertionError, KeyError) as e:
            print(f"{key}: skipped, no stress model ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        model.save_pretrained(folder / key / "base")
        (folder / key / "base" / "README.md").write_text(f"# tiny {key}\n\nA stressed tiny model.\n")
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the same architecture with every weight nudged, as a short fine-tune would
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3 * p.abs().mean())
        model.save_pretrained(folder / key / "nudged")
        built.append(key)
    return built


def jobs(models: Path, out: Path, keys: list[str]) -> list[tuple[str, list[str]]]:
    """(name, CLI arguments) of every command one version runs, in order (apply reads what convert wrote)."""
    todo = []
    for key in keys:
        base, nudged = models / key / "base", models / key / "nudged"
        todo += [(f"{key}/convert", ["convert", str(base), str(out / key / "convert"), *ARGS]),
                 (f"{key}/convert-whole", ["convert", str(base), str(out / key / "convert-whole"), *ARGS, "--whole"]),
                 (f"{key}/apply", ["apply", str(out / key / "convert"), str(nudged), str(out / key / "apply"), *ARGS])]
        if key in FINETUNE_FAMILIES:
            todo.append((f"{key}/finetune", [FINETUNE[0], str(base), str(out / key / "finetune"), *FINETUNE[1:]]))
        if key in RUNTIME_FAMILIES:
            todo += [(f"{key}/convert-runtime-{r}", ["convert", str(base), str(out / key / f"convert-runtime-{r}"), *ARGS,
                                                     "--runtime", r]) for r in ("all-fp16", "ort-webgpu")]
        if key in ONNX_FAMILIES:
            todo += [(f"{key}/convert-to-onnx", ["convert", str(base), str(out / key / "convert-to-onnx"), *ARGS, "--to", "onnx"]),
                     (f"{key}/export-onnx", ["export", "onnx", str(out / key / "convert"), str(out / key / "export-onnx")]),
                     (f"{key}/export-onnx-runtime", ["export", "onnx", str(out / key / "convert"),
                                                     str(out / key / "export-onnx-runtime"), "--runtime", "ort-webgpu"])]
    return todo


def run_side(src: Path, models: Path, out: Path, keys: list[str]) -> dict[str, int]:
    """Run every job with the package in `src`, in one process; returns each job's exit status."""
    # PYTHONHASHSEED fixed: transformers' Gemma 3 forward walks `set(config.layer_types)`, so the traced ONNX graph's
    # choice between its two equal rotary buffers follows Python's string hashing, different in every process
    env = dict(os.environ, PYTHONPATH=str(src), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONHASHSEED="0")
    done = subprocess.run([sys.executable, __file__, "--run", str(models), str(out), *keys], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the runner failed with {src}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _runner(models: Path, out: Path, keys: list[str]) -> None:
    """Inside one version's process: every job through its own CLI; prints {job: exit status} as the last line."""
    import logging
    from contextlib import redirect_stdout

    from halfsafe.cli import main

    logging.disable(logging.WARNING)
    status = {}
    for name, argv in jobs(models, out, keys):
        with open(os.devnull, "w") as quiet, redirect_stdout(quiet):
            status[name] = main(argv)
    print(json.dumps(status))


def base_source(base: str, into: Path) -> Path:
    """`base` as a folder holding the package: given as one (it holds halfsafe/), or a commit of this repository
    whose src/ is unpacked into `into`."""
    folder = Path(base)
    if (folder / "halfsafe").is_dir():
        return folder
    if (folder / "src" / "halfsafe").is_dir():
        return folder / "src"
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", base, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def differences(a: Path, b: Path) -> list[str]:
    """Every file under `a` or `b` that is missing from the other or differs in a byte."""
    files = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    out = []
    for rel in sorted(files):
        x, y = a / rel, b / rel
        if not (x.is_file() and y.is_file()):
            out.append(f"{rel}: only in {'base' if x.is_file() else 'new'}")
        elif not filecmp.cmp(x, y, shallow=False):
            out.append(f"{rel}: differs")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="a commit of this repository, or a folder holding the halfsafe package")
    p.add_argument("--new", default=str(ROOT / "src"), help="the version under test (default: this checkout's src)")
    p.add_argument("--families", nargs="*", help="tiny model keys (default: every one in tests/tiny)")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (models, both sides' outputs)")
    args = p.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="same-bytes-"))
    work.mkdir(parents=True, exist_ok=True)
    for side in ("out", "base", "new"):
        if (work / side).exists():
            raise SystemExit(f"{work / side} exists: give --keep an empty or new folder")
    base = base_source(args.base, work)
    add_paths("tests", "src")  # tests/tiny imports this checkout's halfsafe, as build_models does
    from tiny import TINY

    keys = build_models(work / "models", args.families or sorted(TINY))
    status = {}
    for side, src in (("base", base), ("new", Path(args.new))):
        # both write to the same path (halfsafe.json records where apply's plan came from), then it is set aside
        status[side] = run_side(src, work / "models", work / "out", keys)
        (work / "out").rename(work / side)
    found = [f"{job}: exit {status['base'][job]} (base) and {status['new'][job]} (new)"
             for job in status["base"] if status["base"][job] != status["new"][job]]
    found += differences(work / "base", work / "new")
    compared = sum(1 for p in (work / "base").rglob("*") if p.is_file())
    print(f"{len(keys)} families, {len(status['base'])} commands, {compared} files written by the base version")
    for job, code in status["base"].items():  # the same on both sides, but nothing written to compare
        if code != 0 and status["new"][job] == code:
            print(f"{job}: exit {code} on both sides (compared: no output, same status)")
    for line in found:
        print(line)
    print("same bytes" if not found else f"{len(found)} differences")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if found else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        _runner(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
    else:
        raise SystemExit(main())
