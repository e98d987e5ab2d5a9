"""llama.cpp GGUF of a converted checkpoint, written by llama.cpp's own `convert_hf_to_gguf.py`, and a check.

llama.cpp's converter upcasts bf16 tensors to fp32 before its per-model edits, but leaves fp16 tensors fp16: for
Gemma it then adds 1 to every norm gain (Gemma's RMSNorm computes `x * (1 + w)`) in fp16, which rounds. A
halfsafe checkpoint is fp16 and its Gemma gains are stored as `(1 + w) * 2**k - 1`, so that sum would be rounded
where transformers computes `1.0 + w.float()` in fp32. `prepare_for_llama_cpp` gives the converter a copy with
the 1-D tensors (norm gains, biases) in fp32, exactly the values of the fp16 checkpoint: then its `+ 1` is the
same fp32 sum transformers makes, and every matrix stays the checkpoint's own fp16 bits.

llama.cpp is not a dependency: pass the folder of a llama.cpp checkout (or of the llama-cpp-python source
package's `vendor/llama.cpp`) that holds `convert_hf_to_gguf.py` and `gguf-py`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from ..engine.shards import Shards
from ..errors import HalfsafeError
from ..families import family_for


def _shards(converted: Path) -> Shards:
    """The checkpoint's tensors through the one reader of a model folder (engine.shards: every file resolved inside
    the folder, nothing unpickled); a folder without safetensors is refused in one line."""
    if not any(converted.glob("*.safetensors")):
        raise HalfsafeError(f"{converted} has no *.safetensors: give the folder `halfsafe convert` wrote")
    return Shards(converted)


def prepare_for_llama_cpp(converted: str | Path, out: str | Path) -> Path:
    """Copy `converted` to `out` with every 1-D floating tensor in fp32 (exact); everything else unchanged, each
    weight file under its own name (the index still names them)."""
    from safetensors.torch import save_file

    from ..io.trust import check_folder

    converted, out = Path(converted), Path(out)
    check_folder(converted)  # nothing copied from outside it
    shards = _shards(converted)
    out.mkdir(parents=True, exist_ok=True)
    for f in converted.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    for name in sorted(set(shards.file_of.values())):
        with shards:
            tensors = {k: shards.load(k) for k in shards.keys() if shards.file_of[k] == name}
        tensors = {k: (v.float() if v.dim() == 1 and v.is_floating_point() else v) for k, v in tensors.items()}
        save_file(tensors, out / name, metadata={"format": "pt"})
    return out


def llama_cpp_converter(llama_cpp_dir: str | Path) -> Path:
    script = Path(llama_cpp_dir) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise HalfsafeError(f"{llama_cpp_dir} has no convert_hf_to_gguf.py: give a llama.cpp checkout (or llama-cpp-python's vendor/llama.cpp)")
    return script


def convert_with_llama_cpp(folder: str | Path, out_gguf: str | Path, llama_cpp_dir: str | Path, outtype: str = "f16") -> Path:
    """Run llama.cpp's converter on `folder` (as is: call `prepare_for_llama_cpp` first for a halfsafe checkpoint)."""
    script = llama_cpp_converter(llama_cpp_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(llama_cpp_dir) / "gguf-py"), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", str(out_gguf)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise HalfsafeError(f"llama.cpp's convert_hf_to_gguf.py failed on {folder}: {tail[0]}")
    return Path(out_gguf)


def compare_gguf(gguf_path: str | Path, converted: str | Path) -> dict:
    """Read the GGUF back (`gguf` package) and compare every tensor and the norm eps with the checkpoint.

    Expected values: the checkpoint's tensor; for Gemma norm gains `1.0 + w.float()` (llama.cpp stores the gain
    Gemma's RMSNorm multiplies by). Returns per-tensor results and a summary.
    """
    import gguf

    from ..io.loading import read_config

    converted = Path(converted)
    config = read_config(converted)
    text = config.get_text_config()
    shards = _shards(converted)  # the checkpoint first: a folder naming files outside it is refused before any read
    with shards:
        hf = {k: shards.load(k) for k in shards.keys()}
    reader = gguf.GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    eps_field = reader.fields.get(f"{arch}.attention.layer_norm_rms_epsilon")
    eps_gguf = float(eps_field.parts[-1][0]) if eps_field is not None else None
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, text.num_hidden_layers)
    stored = {t.name: t for t in reader.tensors}
    gain1p = family_for(config.model_type).one_plus_norm_gains  # llama.cpp stores 1 + w for these norms
    rows = []
    for name, w in hf.items():
        base = name.removesuffix(".weight").removesuffix(".bias")
        suffix = name[len(base):]
        gname = name_map.get_name(base.removeprefix("model.") if base.startswith("model.") else base)
        gname = gname or name_map.get_name(base)
        if gname is None or gname + suffix not in stored:
            rows.append({"tensor": name, "gguf": None, "exact": None})
            continue
        t = stored[gname + suffix]
        got = torch.from_numpy(np.array(t.data)).float().reshape(-1)
        want = w.float()
        if gain1p and name.endswith("norm.weight"):
            want = 1.0 + want
        want = want.reshape(-1)[: got.numel()]  # llama.cpp drops Gemma's unused vocabulary rows
        rows.append({"tensor": name, "gguf": gname + suffix, "dtype": t.tensor_type.name,
                     "exact": bool(torch.equal(got, want)), "max_abs_diff": float((got - want).abs().max())})
    found = [r for r in rows if r["exact"] is not None]
    norms = [r for r in found if r["tensor"].endswith("norm.weight")]
    return {
        "arch": arch,
        "eps_config": text.rms_norm_eps if hasattr(text, "rms_norm_eps") else None,
        "eps_gguf": eps_gguf,
        "eps_exact": bool(eps_gguf is not None and np.float32(eps_gguf) == np.float32(text.rms_norm_eps)),
        "tensors_compared": len(found),
        "tensors_not_found": [r["tensor"] for r in rows if r["exact"] is None],
        "exact": sum(r["exact"] for r in found),
        "norm_gains": len(norms),
        "norm_gains_exact": sum(r["exact"] for r in norms),
        "norm_gain_max_abs_diff": max((r["max_abs_diff"] for r in norms), default=0.0),
        "max_abs_diff": max((r["max_abs_diff"] for r in found), default=0.0),
        "rows": rows,
    }
