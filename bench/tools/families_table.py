#!/usr/bin/env python
"""The families table of docs/how-it-works.md, made from the family data itself (groups, what stays unreachable), with the
public checkpoints each family covers (by name, written here: documentation, not architecture knowledge).

    .venv/bin/python bench/tools/families_table.py        # writes bench/results/families.md
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

from halfsafe.families import REGISTRY

WRITES = ("families.md",)  # in bench/results/ (python bench/list.py)

CHECKPOINTS = {
    "bart": "facebook/bart-base/-large (and fine-tunes)",
    "bert": "bert-base/-large (cased, uncased, multilingual)",
    "roberta": "roberta-base/-large, xlm-roberta",
    "deepseek": "DeepSeek-V2(-Chat), V2-Lite, DeepSeek-Coder-V2(-Lite), V2.5; DeepSeek-V3, V3-0324, R1 (bf16 weights)",
    "gemma": "Gemma 2B/7B",
    "gemma2": "Gemma 2 2B/9B/27B",
    "gemma3": "Gemma 3 4B/12B/27B (pt, it): language model, SigLIP tower, projector",
    "gemma3_text": "Gemma 3 270M/1B, EmbeddingGemma 300M",
    "gemma4": "Gemma 4 E2B/E4B/26B-A4B (MoE)/31B and -it, with vision and audio towers",
    "gemma4_text": "Gemma 4 text-only checkpoints",
    "glm4": "GLM-4-9B-0414, GLM-4-32B-0414 (+Base), GLM-Z1-9B/32B-0414",
    "gpt2": "gpt2, distilgpt2 and GPT-2 fine-tunes",
    "gpt_neo": "GPT-Neo 125M/1.3B/2.7B",
    "gpt_neox": "Pythia, GPT-NeoX-20B",
    "gpt_oss": "gpt-oss-20b, gpt-oss-120b",
    "llama": "Llama 2/3, Mistral 7B, Qwen2/2.5 (and their fine-tunes)",
    "longt5": "long-t5-local-base/large, long-t5-tglobal-base/large/xl",
    "mixtral": "Mixtral-8x7B, 8x22B (and -Instruct)",
    "pegasus": "google/pegasus-* (large, xsum, cnn_dailymail, ...)",
    "phi3": "Phi-3/3.5 mini/medium, Phi-4-mini",
    "qwen2_5_vl": "Qwen2.5-VL-3B/7B/32B/72B(-Instruct)",
    "qwen2_moe": "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
    "qwen2_vl": "Qwen2-VL-2B/7B/72B(-Instruct), QVQ-72B-Preview",
    "qwen3": "Qwen3 0.6B-32B",
    "qwen3_moe": "Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B/480B-A35B",
    "t5": "T5, T5 v1.1, Flan-T5, mT5, UMT5, ByT5",
    "t5gemma": "T5Gemma s-s ... 9b-9b (prefixlm, ul2, -it)",
    "t5gemma2": "T5Gemma 2 270m-270m, 1b-1b, 4b-4b",
}


def table() -> str:
    rows = ["| family (data file) | model_type | public checkpoints | groups | not reachable by an exact rescale |",
            "|---|---|---|---|---|"]
    for family in sorted({id(f): f for f in REGISTRY.values()}.values(), key=lambda f: f.name):
        rows.append(f"| {family.name} | {', '.join(family.model_types)} | {CHECKPOINTS.get(family.name, '-')} | "
                    f"{', '.join(g.name for g in family.groups)} | {family.unfixable} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    out = RESULTS / "families.md"
    out.write_text(table())
    print(table())
    sys.exit(0)
