"""llama.cpp's Vulkan backend for tests/test_llama_vulkan.py: the pinned llama-cpp-python built with -DGGML_VULKAN=ON by
scripts/setup-llama-vulkan in halfsafe's cache (once), run on the Mesa lavapipe scripts/install-webgpu unpacks (a CPU
Vulkan device that reports fp16, so ggml takes its float16-accumulator shaders as it does on a GPU).

Before any test trusts the backend, `proof` measures with the setup's f16 probe (scripts/llama-vulkan/f16_probe.c) that
its matrix-matrix products accumulate in float16: a sum of 4096 ones gives 2048 there, 4096 on the matrix-vector path
(N = 1, one-token decode) and with GGML_VK_DISABLE_F16=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import webgpu
from setup_scripts import made_by

from halfsafe.io.cache import cache_dir

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup-llama-vulkan"
SPEC = "llama-cpp-python==0.3.36"  # scripts/setup-llama-vulkan's default pin, scripts/setup-llama-cpp's too

K = 4096  # a float16 running sum of K ones stalls at 2048: 2048 + 1 rounds back to 2048
M = 64
# (K, M, N, GGML_VK_DISABLE_F16) -> what the product of ones gives when the matrix-matrix path accumulates in float16
F16_ANSWERS = {
    (K, M, M, False): K // 2,  # prompt processing: float16 sums
    (K // 2, M, M, False): K // 2,  # 2048 is still exact: the stall is the sum's, not a wrong product
    (K, M, 1, False): K,  # matrix-vector (one-token decode): float32 sums
    (K, M, M, True): K,  # float16 shaders off
}


def environment() -> tuple[Path | None, str]:
    """(the folder scripts/setup-llama-vulkan made: venv/, bin/f16_probe, ...) once it is made, or (None, why not)."""
    return made_by(SETUP, SPEC + " (Vulkan)", "bin/f16_probe", timeout=3600, env={**os.environ, "PYTHON": sys.executable})


def device_missing() -> str | None:
    """Why no Vulkan device can run here (a skip reason), or None: the lavapipe scripts/install-webgpu unpacks."""
    if webgpu.env_file().is_file():
        return None
    why = cache_dir() / "webgpu-missing"  # install-webgpu's one line, when it could not make the adapter
    if why.is_file() and why.read_text().strip():
        return why.read_text().strip().splitlines()[0]
    return f"no lavapipe Vulkan driver: {webgpu.env_file()} missing (scripts/install-webgpu makes it)"


def shader_cache(folder: Path) -> Path:
    """Mesa's cache of compiled pipelines for this build: in its folder (ggml's pipelines take minutes to compile on
    lavapipe, seconds once cached), or $HALFSAFE_SHADER_CACHE to measure without."""
    return Path(os.environ.get(webgpu.SHADER_CACHE_VAR) or folder / "shader-cache")


def runtime_env(folder: Path, disable_f16: bool = False) -> dict:
    """The lavapipe environment (tests/webgpu.py's, with `folder`'s shader cache) where ggml sees it:
    GGML_VK_VISIBLE_DEVICES names it, as ggml skips CPU-type devices otherwise."""
    env = webgpu.runtime_env(shader_cache(folder))
    env["GGML_VK_VISIBLE_DEVICES"] = "0"
    env.pop("GGML_VK_DISABLE_F16", None)
    if disable_f16:
        env["GGML_VK_DISABLE_F16"] = "1"
    return env


def probe(folder: Path, products: list[tuple[int, int, int]], env: dict, timeout: float = 600) -> list[dict]:
    """The setup's f16 probe on Vulkan device 0: per (K, M, N), {"device", "k", "m", "n", "min", "max"} of the product
    of an F16 K x M matrix of ones by an F16 K x N one."""
    args = [str(x) for p in products for x in p]
    done = subprocess.run([str(folder / "bin" / "f16_probe"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"f16_probe {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def proof(folder: Path) -> dict[tuple, dict]:
    """F16_ANSWERS' products measured: (K, M, N, disable_f16) -> the probe's line."""
    measured = {}
    for disable in (False, True):
        cases = [c for c in F16_ANSWERS if c[3] == disable]
        for case, line in zip(cases, probe(folder, [c[:3] for c in cases], runtime_env(folder, disable))):
            measured[case] = line
    return measured


def not_f16(measured: dict[tuple, dict]) -> dict[tuple, tuple]:
    """The proof's products that are not float16 accumulation's answer: case -> ((min, max) measured, the answer)."""
    return {c: ((measured[c]["min"], measured[c]["max"]) if c in measured else None, want)
            for c, want in F16_ANSWERS.items()
            if c not in measured or measured[c]["min"] != want or measured[c]["max"] != want}
