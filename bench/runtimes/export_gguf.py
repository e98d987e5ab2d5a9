"""The converted Gemma 3 270M through llama.cpp's own convert_hf_to_gguf.py, read back and compared.

Two F16 GGUFs of the same halfsafe checkpoint: llama.cpp's converter run on the folder as is (it adds 1 to
Gemma's norm gains in fp16, which rounds), and on `halfsafe.export.gguf.prepare_for_llama_cpp`'s copy (1-D
tensors in fp32, exact). Every tensor and the moved norm eps are compared with the checkpoint (`gguf` reader).
If llama-cpp-python is installed, the F16 GGUF's logits are compared with transformers fp32 too.

Usage: python bench/runtimes/export_gguf.py LLAMA_CPP_DIR [--converted DIR] [--work DIR]
LLAMA_CPP_DIR: a llama.cpp checkout, or `vendor/llama.cpp` of the llama-cpp-python source package.
Writes bench/results/gguf.md and gguf.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

from halfsafe.export.gguf import compare_gguf, convert_with_llama_cpp, prepare_for_llama_cpp
from halfsafe.io.builtin import cache_dir

WRITES = ("gguf.json", "gguf.md")  # in bench/results/ (python bench/list.py)


def llama_cpp_logits(gguf_path: Path, converted: Path, tokens: int = 64) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from halfsafe.calibration import heldout_text, make_samples
    from halfsafe.core.metrics import kl_per_token, top1_agreement

    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = make_samples([heldout_text()], tok, model.config.vocab_size, tokens, 1)[0]
    with torch.no_grad():
        ref = model(ids).logits[0].double()
    llm = Llama(str(gguf_path), n_ctx=tokens + 8, logits_all=True, verbose=False)
    llm.eval(ids[0].tolist())
    out = torch.from_numpy(np.array(llm.scores[: ids.shape[1]], dtype=np.float32)).double()[:, : ref.shape[-1]]
    return {"tokens": int(ids.shape[1]), "kl": float(kl_per_token(ref, out).mean()), "top1": top1_agreement(ref, out),
            "max_abs_logit_diff": float((ref - out).abs().max())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("llama_cpp_dir")
    ap.add_argument("--converted", default=str(cache_dir() / "bench-onnx" / "gemma3-270m-halfsafe"))
    ap.add_argument("--work", default=str(cache_dir() / "bench-gguf"))
    args = ap.parse_args()
    converted, work = Path(args.converted), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    direct, prepared = work / "direct-f16.gguf", work / "halfsafe-f16.gguf"
    if not direct.is_file():
        convert_with_llama_cpp(converted, direct, args.llama_cpp_dir)
    if not prepared.is_file():
        convert_with_llama_cpp(prepare_for_llama_cpp(converted, work / "prepared"), prepared, args.llama_cpp_dir)
    results = {"llama.cpp converter on the fp16 folder as is": compare_gguf(direct, converted),
               "llama.cpp converter on prepare_for_llama_cpp's copy": compare_gguf(prepared, converted)}
    logits = llama_cpp_logits(prepared, converted)
    lines = [f"Gemma 3 270M converted by halfsafe (`{converted.name}`), F16 GGUF written by llama.cpp's `convert_hf_to_gguf.py` "
             f"(from `{args.llama_cpp_dir}`), read back with the `gguf` package. Expected: the checkpoint's tensors, Gemma norm "
             "gains as `1.0 + w.float()` (what transformers multiplies by; llama.cpp stores the sum), the moved eps as in config.json.",
             f"Command: `python bench/runtimes/export_gguf.py {args.llama_cpp_dir}`.", "",
             "| converter input | tensors exact | norm gains exact | largest norm-gain error | eps in GGUF | eps exact |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['exact']}/{r['tensors_compared']} | {r['norm_gains_exact']}/{r['norm_gains']} | "
                     f"{r['norm_gain_max_abs_diff']:.3g} | {r['eps_gguf']:.6g} | {r['eps_exact']} |")
    lines.append("")
    if logits is None:
        lines.append("llama-cpp-python not installed: F16 GGUF logits against transformers fp32 not measured.")
    else:
        lines.append(f"llama.cpp (llama-cpp-python, CPU) F16 GGUF vs transformers fp32, {logits['tokens']} held-out tokens: "
                     f"KL {logits['kl']:.2e}, top-1 {100 * logits['top1']:.2f}%, max |logit diff| {logits['max_abs_logit_diff']:.3g}.")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "gguf.json").write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in results.items()}
                                                  | {"llama_cpp_logits": logits}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
