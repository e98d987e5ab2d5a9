"""The real Gemma 3 270M as F16 GGUFs under llama.cpp's Vulkan backend with float16 accumulators (lavapipe), against
transformers fp32: the unconverted original and halfsafe's converted folder.

llama.cpp's Vulkan backend takes float16-accumulator matrix-matrix shaders on any device that reports fp16 (prompt
processing: N > 1 rows at once); its matrix-vector path (one-token decode) sums in float32. scripts/setup-llama-vulkan
builds it, tests/vulkanenv.py proves the accumulation on the device first (the f16 probe), and this bench refuses to
measure on a device that fails the proof.

Two F16 GGUFs by llama.cpp's own converter (scripts/setup-llama-cpp's), both through `prepare_for_llama_cpp` (1-D
tensors in fp32, exact): the original's bf16 weights cast to fp16 (what a user converting the checkpoint to F16 gets),
and halfsafe's converted folder (`halfsafe convert` at default settings, then `halfsafe export gguf`). Each is run on
the Vulkan backend (every layer offloaded) and on llama.cpp's CPU backend (fp32 sums) for contrast: one prompt of
held-out text evaluated as one batch with every position's logits, then a short greedy decode. Measured against
transformers fp32 of the original: mean KL per prompt token, top-1 agreement, non-finite logits, greedy tokens; and
PyTorch bf16 (CPU) for scale. llama.cpp's Gemma vocabulary drops the unused rows at the end of the embedding: both
sides' logits are compared on the rows llama.cpp keeps.

Usage: python bench/runtimes/llama_vulkan.py [--tokens 128] [--new-tokens 8] [--converted DIR] [--work DIR]
Writes bench/results/llama_vulkan.{json,md}. Slow on lavapipe (pipeline compilation, then float16 shaders on a CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, ROOT, add_paths  # noqa: E402

add_paths("tests", ".")  # tests/vulkanenv.py, tests/llamaenv.py: the set-ups and the runner

import llamaenv  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import vulkanenv  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.core.metrics import kl_per_token, top1_agreement  # noqa: E402
from halfsafe.export.gguf import convert_with_llama_cpp, export_gguf, prepare_for_llama_cpp  # noqa: E402
from halfsafe.io.builtin import gemma3_270m_folder  # noqa: E402
from halfsafe.io.cache import cache_dir  # noqa: E402

WRITES = ("llama_vulkan.json", "llama_vulkan.md")  # in bench/results/ (python bench/list.py)

CASE = ROOT / "tests" / "llama_case.py"


def original_f16(original: Path, out: Path) -> Path:
    """The original checkpoint with its bf16 weights cast to fp16 (each tensor checked finite), config and tokenizer
    copied: the folder a user hands llama.cpp's converter for an F16 GGUF without halfsafe."""
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.to(torch.float16) for k, v in load_file(original / "model.safetensors").items()}
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise SystemExit(f"the original's weights overflow float16: {bad[:5]}")
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    for p in original.iterdir():
        if p.is_file() and p.suffix in {".json", ".model"}:
            shutil.copy(p, tmp / p.name)
    config = json.loads((tmp / "config.json").read_text())
    config["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


def ggufs(original: Path, converted: Path, work: Path, llama_cpp: Path) -> dict[str, Path]:
    made = {"original": work / "original-f16.gguf", "halfsafe": work / "halfsafe-f16.gguf"}
    if not made["original"].is_file():
        folder = prepare_for_llama_cpp(original_f16(original, work / "original-f16"), work / "original-f16-prepared")
        convert_with_llama_cpp(folder, made["original"], llama_cpp)
    if not made["halfsafe"].is_file():
        export_gguf(converted, made["halfsafe"], llama_cpp)
    return made


def run_llama(folder: Path, gguf: Path, ids: list[int], new_tokens: int, env: dict | None, n_gpu_layers: int,
              out: Path) -> dict:
    """tests/llama_case.py in `folder`'s venv: the prompt's logits [T, V'] and the greedy decode, with its seconds.
    Kept in `out` (.npz) and beside it (.json) for the same job: a rerun measures only what is missing."""
    job = {"gguf": str(gguf), "prompts": [ids], "new_tokens": new_tokens, "n_gpu_layers": n_gpu_layers,
           "logits_file": str(out), "seconds": True}
    kept = out.with_suffix(".json")
    if kept.is_file() and out.is_file() and json.loads(kept.read_text())["job"] == job:
        line = json.loads(kept.read_text())["line"]
    else:
        start = time.monotonic()
        done = subprocess.run([str(folder / "venv" / "bin" / "python"), str(CASE), json.dumps(job)],
                              capture_output=True, text=True, env=env, timeout=7200)
        if done.returncode != 0:
            raise SystemExit(f"llama.cpp on {gguf} failed:\n{done.stderr[-4000:]}")
        line = json.loads(done.stdout.strip().splitlines()[-1])
        line["seconds"]["process"] = time.monotonic() - start
        kept.write_text(json.dumps({"job": job, "line": line}))
    arrays = np.load(out)
    return {"logits": torch.from_numpy(arrays["logits_0"]).double(), "greedy": line["runs"][0]["greedy"],
            "seconds": line["seconds"]}


@torch.no_grad()
def reference(original: Path, ids: torch.Tensor, new_tokens: int) -> dict:
    """transformers fp32 of the original: the prompt's logits and its greedy decode; PyTorch bf16's prompt logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    logits = model(ids).logits[0].double()
    seq = ids
    greedy = []
    for _ in range(new_tokens):  # no cache: short, and the same arithmetic as the prompt's pass
        greedy.append(int(model(seq).logits[0, -1].argmax()))
        seq = torch.cat([seq, torch.tensor([[greedy[-1]]])], dim=1)
    bf16 = model.to(torch.bfloat16)(ids).logits[0].double()
    return {"logits": logits, "greedy": greedy, "bf16": bf16}


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Mean KL per token (nats; NaN where any logit is non-finite), top-1 agreement, non-finite counts."""
    ref = ref[:, : got.shape[1]]  # llama.cpp keeps the vocabulary's used rows
    finite = torch.isfinite(got).all(dim=1)
    kl = kl_per_token(ref, got)
    return {"kl_mean": float(kl.mean()), "kl_mean_finite_positions": float(kl[finite].mean()) if finite.any() else None,
            "top1": top1_agreement(ref, got), "nonfinite_logits": int((~torch.isfinite(got)).sum()),
            "nonfinite_positions": int((~finite).sum()), "positions": int(got.shape[0])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128, help="prompt tokens, BOS included (default 128)")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy tokens after the prompt (default 8)")
    ap.add_argument("--converted", default=str(cache_dir() / "bench-llama-vulkan" / "gemma3-270m-halfsafe"),
                    help="halfsafe's converted Gemma 3 270M (`halfsafe convert gemma3-270m DIR`)")
    ap.add_argument("--work", default=str(cache_dir() / "bench-llama-vulkan"))
    ap.add_argument("--cpu-only", action="store_true", help="only llama.cpp's CPU runs (kept for the full run)")
    args = ap.parse_args()
    work, converted, original = Path(args.work), Path(args.converted), gemma3_270m_folder()
    work.mkdir(parents=True, exist_ok=True)
    if not (converted / "halfsafe.json").is_file():
        raise SystemExit(f"{converted} is not a halfsafe checkpoint: run halfsafe convert gemma3-270m {converted}")
    cpu, why = llamaenv.environment()
    if cpu is None:
        raise SystemExit(why)
    backends = [("CPU", cpu, None, 0)]
    proof, device = {}, None
    if not args.cpu_only:
        vulkan, why = vulkanenv.environment()
        if vulkan is None:
            raise SystemExit(why)
        if (why := vulkanenv.device_missing()) is not None:
            raise SystemExit(why)
        proof = vulkanenv.proof(vulkan)
        if wrong := vulkanenv.not_f16(proof):
            raise SystemExit(f"the Vulkan device does not accumulate in f16 ((min, max) measured, f16's answer): {wrong}")
        device = proof[(vulkanenv.K, vulkanenv.M, vulkanenv.M, False)]["device"]
        backends.insert(0, ("Vulkan f16 (lavapipe)", vulkan, vulkanenv.runtime_env(vulkan), -1))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(original)
    ids = make_samples([heldout_text()], tok, 262144, args.tokens, 1)[0]
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"the held-out text gives {ids.shape[1]} tokens, under --tokens {args.tokens}")
    made = ggufs(original, converted, work, cpu / "llama.cpp")
    ref = reference(original, ids, args.new_tokens)
    rows, runs = {"bf16 (PyTorch CPU)": compare(ref["logits"], ref["bf16"]) | {"greedy_equal": None}}, {}
    for name, gguf in made.items():
        for backend, folder, run_env, layers in backends:
            print(f"{name} GGUF on llama.cpp {backend} ...", file=sys.stderr, flush=True)
            got = run_llama(folder, gguf, ids[0].tolist(), args.new_tokens, run_env, layers, work / f"{name}-{layers}.npz")
            key = f"{name} F16 GGUF, llama.cpp {backend}"
            rows[key] = compare(ref["logits"], got["logits"]) | {"greedy": got["greedy"],
                                                                 "greedy_equal": got["greedy"] == ref["greedy"]}
            runs[key] = got["seconds"]
            print(key, json.dumps(rows[key]), json.dumps(runs[key]), file=sys.stderr, flush=True)
    result = {"model": "Gemma 3 270M (halfsafe's fixture, bf16)", "prompt_tokens": int(ids.shape[1]),
              "new_tokens": args.new_tokens, "fp32_greedy": ref["greedy"], "device": device,
              "proof": {f"K={k} M={m} N={n}{' GGML_VK_DISABLE_F16=1' if d else ''}": p["max"]
                        for (k, m, n, d), p in proof.items()},
              "rows": rows, "seconds": runs}
    if args.cpu_only:
        print(json.dumps(result, indent=2))
        return 0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llama_vulkan.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Gemma 3 270M, {result['prompt_tokens']} held-out tokens as one prompt batch, then {args.new_tokens} greedy "
             f"tokens; KL is the mean per prompt token to transformers fp32 of the original (nats). Vulkan device: `{device}`.",
             f"Command: `python bench/runtimes/llama_vulkan.py --tokens {args.tokens} --new-tokens {args.new_tokens}`.",
             "Proof of float16 accumulation on that device (F16 ones x ones): "
             + ", ".join(f"{k}: {v:g}" for k, v in result["proof"].items()) + ".", "",
             "| run | KL mean | top-1 | non-finite logits (positions) | greedy = fp32's |", "|---|---:|---:|---:|---|"]
    for key, r in rows.items():
        lines.append(f"| {key} | {r['kl_mean']:.3g} | {100 * r['top1']:.2f}% | {r['nonfinite_logits']} "
                     f"({r['nonfinite_positions']}/{r['positions']}) | {r['greedy_equal']} |")
    lines.append("")
    lines.append("Seconds per run (wall, lavapipe on 2 shared cores; load, prompt, decode): "
                 + "; ".join(f"{k}: {v['load']:.0f}, {v['prompt_0']:.0f}, {v['decode_0']:.0f}" for k, v in runs.items()))
    (RESULTS / "llama_vulkan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
