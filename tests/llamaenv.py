"""llama.cpp for tests/test_export_gguf.py: the pinned llama-cpp-python built for the CPU by scripts/setup-llama-cpp in
halfsafe's cache (once), with the converter of the same release beside it, which `halfsafe export gguf` finds there.

Each llama.cpp run is tests/llama_case.py in a fresh process of that environment's python (llama_cpp is not
importable in .venv). The tiny models' tokenizer is a sentencepiece model trained here on the embedded text, with
the setup's sentencepiece (the converter reads tokenizer.model with it; .venv has none): llama.cpp's converter
refuses the character tokenizer tests/jsclient.py makes (a BPE pre-tokenizer it does not recognise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.setup_scripts import made_by

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup-llama-cpp"
CASE = Path(__file__).resolve().parent / "llama_case.py"
SPEC = "llama-cpp-python==0.3.36"  # scripts/setup-llama-cpp's default pin


def environment() -> tuple[Path | None, str]:
    """(the folder scripts/setup-llama-cpp made: venv/, llama.cpp/, pylib/) once it is made, or (None, why not: a skip
    reason). The converter's sentencepiece is built for this python, which runs the converter."""
    return made_by(SETUP, SPEC, "venv/bin/python", timeout=3600, env={**os.environ, "PYTHON": sys.executable})


def sentencepiece_model(folder: Path, out: Path, text: str, vocab: int = 160) -> None:
    """A BPE sentencepiece model of at most `vocab` pieces (below the tiny models' 256) trained on the ASCII of
    `text`, written to `out` (tokenizer.model)."""
    text = text.encode("ascii", "ignore").decode()  # every character a piece: the embedded text has 489 kinds
    train = ("import io, sys, sentencepiece as spm; buf = io.BytesIO(); "
             "spm.SentencePieceTrainer.train(sentence_iterator=iter(sys.stdin.read().splitlines()), model_writer=buf, "
             f"vocab_size={vocab}, model_type='bpe', hard_vocab_limit=False, minloglevel=2, pad_id=0, eos_id=1, bos_id=2, "
             "unk_id=3); open(sys.argv[1], 'wb').write(buf.getvalue())")
    subprocess.run([sys.executable, "-c", train, str(out)], input=text, text=True, check=True, capture_output=True,
                   timeout=120, env={**os.environ, "PYTHONPATH": str(folder / "pylib")})


def run(folder: Path, gguf: Path, prompts: list[list[int]], new_tokens: int, n_gpu_layers: int = 0,
        env: dict | None = None, timeout: float = 300) -> list[dict]:
    """tests/llama_case.py on `gguf` (llama.cpp's CPU backend; in scripts/setup-llama-vulkan's `folder`, with
    `n_gpu_layers` -1 and tests/vulkanenv.py's env, its Vulkan backend): per prompt its logits and greedy continuation."""
    job = {"gguf": str(gguf), "prompts": prompts, "new_tokens": new_tokens, "n_gpu_layers": n_gpu_layers}
    done = subprocess.run([str(folder / "venv" / "bin" / "python"), str(CASE), json.dumps(job)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp on {gguf} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
