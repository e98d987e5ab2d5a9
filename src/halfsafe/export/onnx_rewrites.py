"""The exact rewrites a runtime profile needs in the exported graph: norms prescaled and the head split on the model
before export, products split along K in each graph after it."""

from __future__ import annotations

from pathlib import Path

from ..runtime.profiles import RuntimeProfile


def rewrite_for(profile: RuntimeProfile, model, folder: Path) -> tuple[dict[str, dict], int]:
    """The exact graph-level rewrites `profile` needs, made on `model` in place before export: each norm prescaled
    where norm statistics are float16 (onnx_norms, measured on the folder's tokenizer and the embedded text), the
    head split where linears accumulate in float16 (onnx_accumulate; not where the profile splits K in the graph
    itself, onnx_split_k). Returns (prescales, head groups)."""
    from .onnx_accumulate import split_head_

    prescales = {}
    if profile.prescales_norms:
        from .onnx_norms import calibration_ids, prescale_norms_

        ids = calibration_ids(folder, model.config.get_text_config().vocab_size)
        prescales = {n: p.to_dict() for n, p in prescale_norms_(model, profile, ids).items()}
    return prescales, split_head_(model, profile) if profile.splits_head else 1


def split_graph(profile: RuntimeProfile | None, program, counts: dict | None = None) -> None:
    """`profile`'s split-K rewrite (halfsafe.export.onnx_split_k) on an exported graph, in place; the products split
    per kind added to `counts`."""
    split = profile.onnx_split_k if profile is not None else None
    if split is None:
        return
    from .onnx_split_k import split_matmuls_

    done = split_matmuls_(program, split)
    if counts is not None:
        counts.setdefault("rule", done.rule)
        for kind, n in done.split.items():
            counts.setdefault("split", {}).setdefault(kind, 0)
            counts["split"][kind] += n
            counts.setdefault("groups", {}).setdefault(kind, {}).update(done.groups[kind])
