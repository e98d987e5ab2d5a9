"""The model card: halfsafe's section of README.md, made from the saved record (io.report) and nothing else, so the
card says what halfsafe.json says. Appended to the card the source carried over (its own text stays first).

One section for every folder with a plan (convert, finetune, apply), and for a fine-tune that took steps a second
one saying the weights are no longer an exact rescaling. `halfsafe apply` measures none of convert's numbers (peak
before, fp32 change, fp16 check on calibration): its card shows them as nan and None. A folder with an fp16 ONNX
export gets one more (`write_onnx`): what the graph files are and how transformers.js and ONNX Runtime load them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .._version import __version__
from .report import Conversion, Finetuned, Record

FILE = "README.md"
TITLE = "## float16 conversion (halfsafe)"


def write(folder: Path, record: Record) -> None:
    """Append the record's sections to `folder`/README.md (made when the source had none)."""
    path = Path(folder) / FILE
    lines = _conversion(record)
    if record.finetuned is not None and record.finetuned.report.steps:
        lines += _finetune(record.finetuned)
    text = path.read_text() if path.exists() else ""
    path.write_text(text.rstrip() + "\n" + "\n".join(lines) + "\n")


def _conversion(record: Record) -> list[str]:
    plan, c = record.plan, record.conversion
    res = plan.exponents.get("residual")
    margin = c.margin if c is not None else None
    return [
        "",
        TITLE,
        "",
        f"Converted from `{record.source}` by halfsafe {__version__}: an exact, function-preserving",
        "power-of-two rescaling of the weights, so the model runs in float16 without inf/NaN. This is an",
        "ordinary float16 checkpoint: load it with plain transformers (`dtype=torch.float16`), no custom code.",
        "",
        f"- family: {plan.family}, model_type: {plan.model_type}",
        f"- residual-stream scale: 2^{res}" if res is not None else "- no residual-stream scale (per-norm scales)",
        f"- tensors rescaled: {len(plan.tensors)}; norm eps moved by 2^{plan.eps_exponent}"
        + "".join(f"; {k} by 2^{v}" for k, v in plan.eps_fields.items()),
        f"- margin: {plan.headroom_bits:.2f} bits under 65504, made for contexts up to {plan.context_length} tokens"
        + (f" ({margin.rule})" if margin else ""),
        f"- activation peak before: {_measured(c, 'peak_before'):.4g}",
        f"- check on calibration text: fp16 finite = {c.fp16_finite_on_calibration if c is not None else None}, "
        f"fp32 output change = {_measured(c, 'fp32_output_change'):.2e}",
        "",
        "`halfsafe.json` beside the weights lists every rescaled tensor with its exponent and the measurements.",
    ]


def _measured(c: Conversion | None, name: str) -> float:
    return getattr(c, name) if c is not None else math.nan


def _finetune(done: Finetuned) -> list[str]:
    report, fp16 = done.report, done.fp16_check
    return [
        "",
        "## float16 penalty fine-tune (halfsafe finetune)",
        "",
        "After the exact rescaling above, some activations no exact rescaling reaches were still above the",
        f"threshold ({report.threshold:g}); the model was fine-tuned for {report.steps} steps to bring them down while",
        "staying close to the original (KL distillation on the original's logits). These weights are therefore",
        f"*not* an exact rescaling: mean KL to the original {report.kl:.2e} nats/token on the fine-tune text.",
        "",
        f"- sites fine-tuned: {', '.join(report.watched[:6])}{' ...' if len(report.watched) > 6 else ''}",
        f"- stop: {report.stop_reason}",
        f"- largest |x| after (float32): {report.max_peak_after:.4g} at {report.max_site_after}",
        f"- float16 check: finite = {fp16['finite']}, largest |x| {fp16['peak']:.4g}",
    ]


ONNX_TITLE = "## fp16 ONNX (halfsafe export onnx)"

# per task: the example call on the card, and what the graph takes and gives (for ONNX Runtime users)
_ONNX_CALLS = {
    "text-generation": "const out = await pipe('The quick brown fox', { max_new_tokens: 32, do_sample: false });",
    "text2text-generation": "const out = await pipe('translate English to German: Hello', { max_new_tokens: 32, do_sample: false });",
    "feature-extraction": "const out = await pipe('The quick brown fox', { pooling: 'none' });  // last_hidden_state",
    "fill-mask": "const out = await pipe('The quick brown {mask} jumps over the lazy dog.');",
}
_ONNX_IO = {
    "text-generation": "`input_ids`, `attention_mask`, `position_ids` (int64) and an fp16 KV cache `past_key_values.{i}.key|value` "
                       "[batch, kv_heads, past, head_dim] (empty at the start) -> `logits`, `present.{i}.key|value`.",
    "text2text-generation": "the encoder (`input_ids`, `attention_mask` -> `last_hidden_state`), then the decoder (`input_ids`, "
                            "`encoder_attention_mask`, `encoder_hidden_states`, fp16 `past_key_values.{i}.decoder.key|value`, "
                            "empty at the start -> `logits`, `present.{i}.decoder|encoder.key|value`).",
    "feature-extraction": "`input_ids`, `attention_mask` (and `token_type_ids` where the model has token types; int64) -> "
                          "`last_hidden_state` (float32).",
    "fill-mask": "`input_ids`, `attention_mask` (and `token_type_ids` where the model has token types; int64) -> `logits` "
                 "(float32).",
}


def write_onnx(folder: Path, files: list[str], clip_nodes: int, task: str = "text-generation",
               no_js_class: str | None = None, name: str | None = None) -> None:
    """The card's ONNX section for the graph `files` in `folder` (`clip_nodes`: how many they hold together), replacing
    any earlier one. `no_js_class`: the model type transformers.js has no class for, then ONNX Runtime only. In a
    folder without PyTorch weights the conversion section (which says to load them with transformers) is cut down.
    `name`: the folder's name once in place (default: `folder`'s own; a temporary folder's name is not the model's)."""
    path = folder / FILE
    text = path.read_text() if path.is_file() else ""
    torch_weights = any(folder.glob("*.safetensors"))
    if not torch_weights and TITLE in text:
        text = text[: text.index(TITLE)].rstrip() + "\n"
    if ONNX_TITLE in text:
        text = text[: text.index(ONNX_TITLE)].rstrip() + "\n"
    name = name or folder.name
    converted = (folder / "halfsafe.json").is_file()
    sizes = ", ".join(f"`{f}` ({sum(p.stat().st_size for p in folder.glob(f + '*')) / 2**20:,.0f} MiB)" for f in files)
    generates = task in ("text-generation", "text2text-generation")
    output = "logits" if task != "feature-extraction" else "last_hidden_state"
    mask = _tokenizer_field(folder, "mask_token") or "[MASK]"
    clips = f"{clip_nodes} Clip nodes, the modeling code's own fp16 clamp (none added)" if clip_nodes else "no Clip nodes"
    lines = [
        "", ONNX_TITLE, "",
        ("Converted by halfsafe (an exact power-of-two rescaling; `halfsafe.json` lists every rescaled tensor), then "
         if converted else "Not converted by halfsafe (no `halfsafe.json`): its fp16 activations may overflow. ")
        + f"exported to float16 ONNX: {sizes}. fp16 weights{', fp16 KV cache' if generates else ''}, {clips}; "
        f"float32 {output} (a Cast at the end of the graph). " + ("" if torch_weights else "There are no PyTorch weights here: load it with "
                                                                 "transformers.js or ONNX Runtime, not transformers."),
    ]
    if no_js_class:
        lines += ["", f"transformers.js (3.8.1, 4.3.2) has no model class for {no_js_class}: run it with ONNX Runtime."]
    else:
        lines += [
            "",
            "transformers.js (Node or a browser; tested with 3.8.1 and 4.3.2 in Node 20"
            + (", and on the WASM backend in Chromium" if task == "text-generation" else "") + "):",
            "",
            "```js",
            "import { env, pipeline } from '@huggingface/transformers';",
            "env.allowRemoteModels = false;",
            f"env.localModelPath = '/path/to/the/folder/above/{name}/';",
            f"const pipe = await pipeline('{task}', '{name}');  // fp16 from config.json",
            _ONNX_CALLS[task].replace("{mask}", mask),
            "```",
            "",
            "Where npm cannot reach onnxruntime-node's download host, `npm install @huggingface/transformers --ignore-scripts`",
            "installs it all the same (the CPU binaries are in the npm package).",
        ]
    lines += ["", "ONNX Runtime: " + _ONNX_IO[task]]
    path.write_text(text.rstrip() + "\n" + "\n".join(lines) + "\n")


def _tokenizer_field(folder: Path, key: str):
    path = folder / "tokenizer_config.json"
    try:
        value = json.loads(path.read_text()).get(key) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return value.get("content") if isinstance(value, dict) else value
