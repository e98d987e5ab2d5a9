"""A real float16 runtime for the tests: ONNX Runtime's WebGPU provider (onnxruntime-node, which transformers.js uses
for device 'webgpu' in Node) on Mesa's lavapipe, a CPU Vulkan driver with shaderFloat16 that scripts/install-webgpu
unpacks into halfsafe's cache with an env file to source. ONNX Runtime's CPU provider computes a float16 graph in
float32, so only this runtime shows what float16 arithmetic does to an export.

Before any test trusts the adapter, `f16_proof` measures that it computes in float16 (tiny graphs whose answers in
float16 and in float32 differ; inputs are graph inputs, so nothing is folded at load time). `placements` tells which
nodes of a model ONNX Runtime leaves on its CPU provider beside WebGPU (those compute in float32).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jsclient
import numpy as np

from halfsafe.io.cache import cache_dir

INSTALLER = Path(__file__).resolve().parent.parent / "scripts" / "install-webgpu"
PROOF_SCRIPT = jsclient.CLIENTS / "f16_proof.mjs"
SHADER_CACHE_VAR = "HALFSAFE_SHADER_CACHE"  # set to a fresh folder to measure the tests with no compiled shaders

K = 4096  # a float16 running sum of K ones stalls at 2048: 2048 + 1 rounds back to 2048
SMALL = 0.0004  # under half of float16's spacing at 1 (2**-10): 1 + SMALL rounds to 1
# what the proof graph gives in float16; ONNX Runtime's CPU provider gives 4096, 300 and SMALL for the three that differ
F16_ANSWERS = {
    "sum_of_ones": float(K // 2),  # MatMul [1, K] x [K, 4] of ones
    "product": float("inf"),  # 300 * 300: 90000 > 65504
    "product_over_300": float("inf"),  # (300 * 300) / 300: 300 if the product was kept in float32
    "one_plus_small": 1.0,  # 1 + SMALL
    "one_plus_small_minus_one": 0.0,  # (1 + SMALL) - 1: SMALL if the sum was kept in float32
}


@dataclass(frozen=True)
class Runtime:
    """A WebGPU adapter proven to compute in float16: the environment that runs it, and what the proof measured."""

    env: dict
    proof: dict


def env_file() -> Path:
    """The env file scripts/install-webgpu writes for the Mesa version it pins."""
    mesa = re.search(r"^MESA=(\S+)", INSTALLER.read_text(), re.MULTILINE).group(1)
    return cache_dir() / f"webgpu-mesa-{mesa.split('-')[0]}" / "env"


def adapter_missing() -> str | None:
    """Why the WebGPU tests cannot run here (a skip reason), or None."""
    reason = jsclient.node_missing()
    if reason is not None:
        return reason
    if env_file().is_file():
        return None
    why = cache_dir() / "webgpu-missing"  # install-webgpu's one line, when it could not make the adapter
    if why.is_file() and why.read_text().strip():
        return why.read_text().strip().splitlines()[0]
    return f"no software WebGPU adapter: {env_file()} missing (scripts/install-webgpu makes it)"


def runtime_env(shader_cache: str | Path | None = None, file: Path | None = None) -> dict:
    """os.environ plus the env file's variables (`file`, else install-webgpu's), as bash sets them when it sources the
    file (the installers quote them for the shell), with MESA_SHADER_CACHE_DIR moved to `shader_cache` or
    $HALFSAFE_SHADER_CACHE when given."""
    env = dict(os.environ)
    file = file or env_file()
    names = re.findall(r"^export (\w+)=", file.read_text(), re.MULTILINE)
    dump = '. "$1" || exit 1; shift; for name; do printf "%s\\0" "${!name}"; done'
    done = subprocess.run(["bash", "-c", dump, "bash", str(file), *names], env=env, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise ValueError(f"{file}: bash cannot source it: {done.stderr.decode(errors='replace').strip()}")
    env.update(zip(names, os.fsdecode(done.stdout).split("\0")))
    shader_cache = shader_cache or os.environ.get(SHADER_CACHE_VAR)
    if shader_cache:
        env["MESA_SHADER_CACHE_DIR"] = str(shader_cache)
    return env


def _half_bits(x: float) -> int:
    return int(np.array(x, np.float16).view(np.uint16))


def _proof_graph(path: Path) -> dict:
    """The proof's ONNX graph at `path`; returns its inputs for f16_proof.mjs (dims, the float16 bits of every element)."""
    import onnx
    from onnx import TensorProto, helper

    shapes = {"ones_row": [1, K], "ones_matrix": [K, 4], "three_hundred": [4], "one": [4], "small": [4]}
    fills = {"ones_row": 1.0, "ones_matrix": 1.0, "three_hundred": 300.0, "one": 1.0, "small": SMALL}
    nodes = [
        helper.make_node("MatMul", ["ones_row", "ones_matrix"], ["sum_of_ones"]),
        helper.make_node("Mul", ["three_hundred", "three_hundred"], ["product"]),
        helper.make_node("Div", ["product", "three_hundred"], ["product_over_300"]),
        helper.make_node("Add", ["one", "small"], ["one_plus_small"]),
        helper.make_node("Sub", ["one_plus_small", "one"], ["one_plus_small_minus_one"]),
    ]
    graph = helper.make_graph(
        nodes, "f16_proof",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [1, 4] if n == "sum_of_ones" else [4]) for n in F16_ANSWERS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return {n: {"dims": shapes[n], "bits": _half_bits(fills[n])} for n in shapes}


def f16_proof(env: dict, device: str = "webgpu", timeout: float = 300) -> dict[str, float]:
    """What the proof graph gives on ONNX Runtime's `device` provider in Node (every node on it): output -> the first
    element (all are equal), as a float. In float16 arithmetic it equals F16_ANSWERS."""
    jsclient.install()
    with tempfile.TemporaryDirectory(prefix="halfsafe-f16-proof-") as tmp:
        model = Path(tmp) / "f16_proof.onnx"
        inputs = _proof_graph(model)
        args = {"model": str(model), "device": device, "inputs": inputs}
        done = subprocess.run(["node", str(PROOF_SCRIPT), json.dumps(args)], cwd=jsclient.CLIENTS, capture_output=True,
                              text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-node ({device}) could not run the float16 proof:\n{done.stderr[-4000:]}")
    outputs = json.loads(done.stdout.strip().splitlines()[-1])["outputs"]
    values = {name: np.array(bits, np.uint16).view(np.float16).astype(np.float64) for name, bits in outputs.items()}
    assert all((v == v[0]).all() or np.isnan(v).all() for v in values.values()), values
    return {name: float(v[0]) for name, v in values.items()}


def not_f16(measured: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The proof's outputs that differ from float16's answers: name -> (measured, float16's)."""
    return {n: (measured.get(n), want) for n, want in F16_ANSWERS.items() if measured.get(n) != want}


_ALL_PLACED_ON = re.compile(r"All nodes placed on \[(\w+)\]")  # one provider for the whole graph: no node listed
_PLACED_ON = re.compile(r"Node\(s\) placed on \[(\w+)\]")
_PLACED_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s+(\w+) \((.*)\)$")


def placements(model: str | Path, env: dict, device: str = "webgpu", timeout: float = 300) -> dict[str, str]:
    """node name -> the execution provider ONNX Runtime placed it on, when `model` is opened on `device` (read from
    its verbose log: clients/js/placements.mjs)."""
    jsclient.install()
    args = {"model": str(model), "device": device}
    done = subprocess.run(["node", str(jsclient.CLIENTS / "placements.mjs"), json.dumps(args)], cwd=jsclient.CLIENTS,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-node ({device}) could not open {model}:\n{done.stderr[-4000:]}")
    if m := _ALL_PLACED_ON.search(done.stderr):
        import onnx

        return {n.name: m.group(1) for n in onnx.load(str(model), load_external_data=False).graph.node}
    placed, provider = {}, None
    for line in done.stderr.splitlines():
        if m := _PLACED_ON.search(line):
            provider = m.group(1)
        elif provider and (m := _PLACED_NODE.search(line)):
            placed[m.group(2)] = provider
    if not placed:
        raise RuntimeError(f"no node placements in onnxruntime-node's verbose log:\n{done.stderr[-2000:]}")
    return placed


_DTYPE_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.int64): "int64"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def run_graphs(runs: list[tuple[Path, dict]], folder: Path, env: dict) -> list[dict[str, np.ndarray]]:
    """[(model file, {input name: array})] -> [{output name: array}], all run on ONNX Runtime's WebGPU provider by one
    Node process (clients/js/ort_op.mjs) in `env` (runtime_env)."""
    jsclient.install()
    specs = []
    for i, (model, inputs) in enumerate(runs):
        case = folder / f"run{i}"
        case.mkdir(parents=True, exist_ok=True)
        feeds = {}
        for name, a in inputs.items():
            file = case / f"{name}.bin"
            np.ascontiguousarray(a).tofile(file)
            feeds[name] = {"file": str(file), "dtype": _DTYPE_NAMES[a.dtype], "dims": list(a.shape)}
        specs.append({"model": str(model), "inputs": feeds, "out": str(case / "out")})
    args = json.dumps({"device": "webgpu", "runs": specs})
    done = subprocess.run(["node", str(jsclient.CLIENTS / "ort_op.mjs"), args], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outs = []
    for spec, result in zip(specs, results):
        outs.append({name: np.fromfile(Path(spec["out"]) / f"{name}.bin", dtype=_DTYPES[o["dtype"]]).reshape(o["dims"])
                     for name, o in result["outputs"].items()})
    return outs
