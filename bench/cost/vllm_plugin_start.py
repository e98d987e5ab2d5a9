"""What halfsafe's vLLM plugin adds to a vLLM start: the wrapped `_get_and_verify_dtype` on a multi-GB fp16 folder, in
real vLLM (scripts/setup-vllm's environment), the first call against one whose folder is known by file identity
(halfsafe_serve.verified): in the same process, and in a new process through the cache file.

    .venv/bin/python bench/cost/vllm_plugin_start.py [--gb 4] [--folder DIR] [--vllm-python PY] [--out FILE]

The folder (default bench/results/tmp/vllm-plugin-start) is a Gemma 3 text config with a 4-GB embedding
(vocab_size x hidden_size in float16, random bytes: real data, no holes) in two safetensors shards and an index, and
a halfsafe.json that fingerprints them. Each row is a fresh vLLM process with a fresh halfsafe cache folder unless
said; "cold": the shards' pages dropped from the page cache first (posix_fadvise DONTNEED, these files only).
vLLM's own function (the table's entry lifted by hand) is timed beside it: what vLLM costs without the plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import ROOT  # noqa: E402

WRITES = ("vllm_plugin_start.md",)  # in bench/results/ (python bench/list.py)

HIDDEN = 1024


def worker(job: dict) -> dict:
    """In the vLLM environment: the seconds of each wrapped call on the folder (and of vLLM's own function)."""
    from transformers import AutoConfig
    from vllm.config import model as config_model

    from halfsafe_serve import vllm as plugin

    plugin.register()
    wrapped, table = config_model._get_and_verify_dtype, config_model._FLOAT16_NOT_SUPPORTED_MODELS
    config = AutoConfig.from_pretrained(job["folder"])
    if job.get("cold"):
        for p in Path(job["folder"]).glob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    out = {"calls": []}
    for _ in range(job["calls"]):
        start = time.perf_counter()
        dtype = wrapped(job["folder"], config, "float16", is_pooling_model=False)
        out["calls"].append(time.perf_counter() - start)
        assert str(dtype) == "torch.float16", dtype
    reason = table.pop(config.model_type)
    try:
        start = time.perf_counter()
        wrapped.__wrapped__(job["folder"], config, "float16", is_pooling_model=False)
        out["vllm_alone"] = time.perf_counter() - start
    finally:
        table[config.model_type] = reason
    return out


def build(folder: Path, gb: float) -> None:
    """The fp16 folder: config.json, two shards of one embedding's halves, their index, a fingerprinting halfsafe.json."""
    import numpy as np
    from transformers import Gemma3TextConfig

    from halfsafe_serve.fingerprint import fingerprint

    rows = int(gb * 2**30 / (HIDDEN * 2)) // 2 * 2
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = Gemma3TextConfig(vocab_size=rows, hidden_size=HIDDEN, intermediate_size=2048, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, dtype="float16",
                              architectures=["Gemma3ForCausalLM"])
    config.save_pretrained(tmp)
    rng, index = np.random.default_rng(0), {}
    for shard in (1, 2):
        name, tensor = f"model-0000{shard}-of-00002.safetensors", f"model.embed_tokens.part{shard}"
        nbytes = rows // 2 * HIDDEN * 2
        header = json.dumps({tensor: {"dtype": "F16", "shape": [rows // 2, HIDDEN], "data_offsets": [0, nbytes]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(tmp / name, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            left = nbytes
            while left:  # random normal halves: real bytes, as a trained embedding's are
                n = min(left, 64 << 20)
                f.write(rng.standard_normal(n // 2, dtype=np.float32).astype(np.float16).tobytes())
                left -= n
        index[tensor] = name
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    record = {"format": 1, "plan": {}, "fp16_finite_on_calibration": True, "unfixable": [], "fingerprint": fingerprint(tmp)}
    (tmp / "halfsafe.json").write_text(json.dumps(record))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--folder")
    ap.add_argument("--vllm-python", help="a Python with vLLM (default: scripts/setup-vllm's environment)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/vllm_plugin_start.md"))
    args = ap.parse_args(argv)
    folder = Path(args.folder) if args.folder else ROOT / "bench/results/tmp/vllm-plugin-start"
    if not (folder / "halfsafe.json").is_file():
        build(folder, args.gb)
    size = sum(p.stat().st_size for p in folder.iterdir())
    if args.vllm_python:
        python = Path(args.vllm_python)
    else:
        setup = subprocess.run([str(ROOT / "scripts/setup-vllm")], capture_output=True, text=True, check=True)
        python = Path(setup.stdout.strip().splitlines()[-1]) / "bin/python"
    cache = Path(tempfile.mkdtemp(prefix="halfsafe-bench-cache-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

    def run(calls: int, cold: bool, fresh: bool) -> dict:
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)
        job = {"folder": str(folder), "calls": calls, "cold": cold}
        done = subprocess.run([str(python), __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                              env={**env, "HALFSAFE_CACHE": str(cache)}, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    rows = [("first call, no cache, cold page cache", run(2, True, True)),
            ("first call, no cache, warm page cache", run(2, False, True)),
            ("a new process, the cache file from the one before", run(1, False, False)),
            ("a new process, the cache file, cold page cache", run(1, True, False))]
    lines = [f"halfsafe's vLLM plugin at a vLLM start: `_get_and_verify_dtype` wrapped, on a {size / 1e9:.2f} GB fp16 "
             f"folder (2 shards), {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at the end), vLLM from "
             f"{python}", "",
             "| process | first call, s | second call in the process, ms | vLLM's function alone, ms |", "|---|---|---|---|"]
    for name, r in rows:
        second = f"{r['calls'][1] * 1e3:.1f}" if len(r["calls"]) > 1 else "-"
        lines.append(f"| {name} | {r['calls'][0]:.3f} | {second} | {r['vllm_alone'] * 1e3:.2f} |")
    shutil.rmtree(cache, ignore_errors=True)
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    else:
        main()
