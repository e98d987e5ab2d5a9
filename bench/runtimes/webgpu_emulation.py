"""The `ort-webgpu` profile's emulation against the real provider on the real Gemma 3 270M, logit for logit: halfsafe's
default export (its split-K) and the plain graph, run by onnxruntime-node's WebGPU provider on lavapipe twice, the
graph fed directly (tests/webgpu.py's run_graphs: positions from 0, as transformers numbers them) and through
transformers.js 4 (which numbers Gemma 3's positions from 1), each against the emulated converted checkpoint given the
same positions. Writes bench/results/webgpu_emulation.{md,json}: the share of the 48 x 262144 logits equal bit for bit,
the largest difference and the KL of each to transformers fp32. Uses bench/runtimes/webgpu.py's exports (made once in its
work folder). Command: `python bench/runtimes/webgpu_emulation.py [--tokens 48] [--variants default,plain]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_webgpu", HERE / "webgpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # also puts tests/ on sys.path

import onnx  # noqa: E402
import webgpu  # noqa: E402
from test_ort_webgpu_model import _feeds  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.core.metrics import mean_kl  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE  # noqa: E402
from halfsafe.runtime.emulate import emulate_runtime  # noqa: E402
from halfsafe.runtime.profiles import SplitK, get_profile  # noqa: E402

WRITES = ("webgpu_emulation.json", "webgpu_emulation.md")  # in bench/results/ (python bench/list.py)


def split_of(work: Path, name: str) -> SplitK:
    """The split-K the export `name` was written with (its export report)."""
    rule = json.loads((work / f"{name}.export.json").read_text())
    rule = rule.get("split_k", rule).get("rule") or SplitK().to_dict()
    terms = rule["terms"]
    return SplitK(terms=tuple(terms) if isinstance(terms, list) else terms, groups=tuple(rule["groups"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--variants", default="default,plain")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "halfsafe-bench-webgpu"))
    args = ap.parse_args()
    if webgpu.adapter_missing():
        sys.exit(webgpu.adapter_missing())
    work, source = Path(args.work), bench.gemma3_270m_folder()
    converted = work / "converted"
    if not (converted / "halfsafe.json").is_file():
        bench.convert_checkpoint(str(source), str(converted), progress=False, overwrite=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    ids = make_samples([heldout_text()], tok, tok.vocab_size, args.tokens, 1)[0]
    fp32 = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    half = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float16).eval()
    env, rows = webgpu.runtime_env(), {}
    torch.set_num_threads(1)
    for name in args.variants.split(","):
        folder = bench.export(work, name, source, converted)
        profile = replace(get_profile("ort-webgpu"), split_k=split_of(work, name))
        feeds = _feeds(onnx.load(str(folder / ONNX_FILE), load_external_data=False).graph, ids.numpy().astype(np.int64))
        with tempfile.TemporaryDirectory() as tmp:
            direct = torch.from_numpy(webgpu.run_graphs([(folder / ONNX_FILE, feeds)], Path(tmp), env)[0]["logits"]).float()
        _, via_js = bench.run_client(folder, ids, 0, 1, "webgpu")
        for client, real, start in (("ONNX Runtime, graph fed directly", direct, 0), ("transformers.js 4", via_js.float(), 1)):
            pos = torch.arange(start, start + ids.shape[1])[None]
            with torch.no_grad():
                ref = fp32(ids, position_ids=pos).logits.double()
                with emulate_runtime(half, profile):
                    emulated = half(ids, position_ids=pos).logits.float()
            rows[f"{name} / {client}"] = {"split_k": profile.split_k.label, "positions_from": start,
                                          "equal": float((emulated == real).double().mean()),
                                          "max_abs_diff": float((emulated - real).abs().max()),
                                          "kl_runtime": mean_kl(ref, real), "kl_emulated": mean_kl(ref, emulated)}
            print(json.dumps({k: v for k, v in rows.items() if k.startswith(name)}), flush=True)
    lines = [f"The `ort-webgpu` emulation against ONNX Runtime's WebGPU provider (onnxruntime-node, lavapipe) on the real "
             f"Gemma 3 270M, {args.tokens} tokens of the embedded held-out text, all 262144 logits per token. Command: "
             f"`python bench/runtimes/webgpu_emulation.py --tokens {args.tokens} --variants {args.variants}`.", "",
             "| export / client | split-K | positions from | logits equal bit for bit | largest difference | KL runtime | KL emulated |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for key, r in rows.items():
        lines.append(f"| {key} | {r['split_k']} | {r['positions_from']} | {100 * r['equal']:.2f}% | {r['max_abs_diff']:.3g} | "
                     f"{r['kl_runtime']:.3e} | {r['kl_emulated']:.3e} |")
    (RESULTS / "webgpu_emulation.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "webgpu_emulation.json").write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
