"""ONNX graphs on ONNX Runtime's WebGPU provider in Node (clients/js/ort_op.mjs: transformers.js 4's onnxruntime-node)
over Mesa's lavapipe, the real float16 adapter scripts/install-webgpu puts in halfsafe's cache: the skip reason,
the environment that selects the adapter, and one Node process running many graphs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
from jsclient import CLIENTS, install, node_missing

from halfsafe.io.cache import cache_dir

ENV_FILE = cache_dir() / "webgpu-mesa-25.0.7" / "env"  # what scripts/install-webgpu writes
RUNNER = CLIENTS / "ort_op.mjs"
NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.int64): "int64"}
DTYPES = {name: dtype for dtype, name in NAMES.items()}


def adapter_missing() -> str | None:
    """Why the WebGPU runtime cannot run here (a skip reason), or None."""
    if not ENV_FILE.is_file():
        return f"no software WebGPU adapter ({ENV_FILE} absent: scripts/install-webgpu)"
    return node_missing()


def runtime_env() -> dict:
    """The environment with the env file's exports applied (lavapipe's libraries, its ICD, the shader cache)."""
    out = subprocess.run(["bash", "-c", 'source "$1" && env -0', "-", str(ENV_FILE)], capture_output=True, check=True)
    return dict(line.split("=", 1) for line in out.stdout.decode().split("\0") if "=" in line)


def run_graphs(runs: list[tuple[Path, dict]], folder: Path) -> list[dict[str, np.ndarray]]:
    """[(model file, {input name: array})] -> [{output name: array}], all run by one Node process on WebGPU."""
    install()
    specs = []
    for i, (model, inputs) in enumerate(runs):
        case = folder / f"run{i}"
        case.mkdir(parents=True, exist_ok=True)
        feeds = {}
        for name, a in inputs.items():
            file = case / f"{name}.bin"
            np.ascontiguousarray(a).tofile(file)
            feeds[name] = {"file": str(file), "dtype": NAMES[a.dtype], "dims": list(a.shape)}
        specs.append({"model": str(model), "inputs": feeds, "out": str(case / "out")})
    args = json.dumps({"device": "webgpu", "runs": specs})
    done = subprocess.run(["node", str(RUNNER), args], capture_output=True, text=True, env=runtime_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outs = []
    for spec, result in zip(specs, results):
        outs.append({name: np.fromfile(Path(spec["out"]) / f"{name}.bin", dtype=DTYPES[o["dtype"]]).reshape(o["dims"])
                     for name, o in result["outputs"].items()})
    return outs
