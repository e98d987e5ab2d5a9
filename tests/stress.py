"""Stress models that overflow float16 in their *activations only*, built without any of halfsafe's code.

Real bf16-pretrained models overflow through a few "massive" residual channels that grow with depth
(the BOS token's channels in Gemma, T5's `wo` outputs), while every weight stays small. This module makes
the same shape from a tiny random model: the tensors that write into the residual stream (the embedding,
each block's output projections, or, in post-norm and sandwich-norm blocks, the norm gains that write it)
are amplified on a few channels only, more in deeper blocks, by a power of two chosen until the fp32
residual stream passes float16's maximum by at least 2 bits while every weight stays under 65504.

The table below is written from the transformers modeling files, on purpose apart from halfsafe's family
data: a mistake in the family data cannot hide itself here. Amplifying channels is not a rescaling, so the
stress model computes a *different* function; it is the fp32 reference the conversion must then match.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

FP16_MAX = 65504.0
CHANNELS = (3, 17, 41)  # the massive channels (hidden size 64 in tests/tiny)

# How a tensor writes channel c of the residual stream:
COL = "col"  # an embedding [vocab, hidden] or a GPT-2 Conv1D [in, hidden]: column c
ROW = "row"  # a Linear [hidden, in]: row c, and its bias[c]
GAIN = "gain"  # a norm gain x*w (LayerNorm, T5/Llama RMSNorm): w[c], and the norm's bias[c]
GAIN1P = "gain1p"  # a Gemma x*(1+w) gain: (1+w[c]) amplified
EXPERT_ROW = "expert_row"  # fused expert down projections [experts, hidden, in]: hidden row c of every expert
EXPERT_COL = "expert_col"  # gpt-oss stores them [experts, in, hidden]: column c, and the bias [experts, hidden]
FEED = "feed"  # what a writer reads (up_proj, v_proj, fc1, wi): the whole tensor, so the writer's input grows
READ = "read"  # a post-norm model's query/key read the amplified stream directly: columns c shrink by the same
# factor, as trained models keep attention logits moderate on their massive (attention-sink) channels
FEED_LAST = "feed_last"  # the same for the last part of a fused tensor along its output dim (phi3 gate_up: up)

_DECODER_LM = [(r"\.self_attn\.o_proj\.weight", ROW), (r"\.mlp\.down_proj\.weight", ROW),
               (r"\.mlp\.up_proj\.weight", FEED), (r"\.self_attn\.v_proj\.weight", FEED)]
# sandwich norms: o_proj/down_proj rows make the massive channels dominate what the post-norm normalises
_SANDWICH = [(r"\.post_attention_layernorm\.weight", GAIN1P),
             (r"\.post_feedforward_layernorm\.weight", GAIN1P), (r"\.self_attn\.o_proj\.weight", ROW),
             (r"\.mlp\.down_proj\.weight", ROW)]
# Gemma 4: x*w sandwich norms; the towers (vision, audio) are left as they are
_LM = r"^(?!.*(vision|audio|visual)).*"
_GEMMA4 = [(_LM + r"\.post_attention_layernorm\.weight$", GAIN), (_LM + r"\.post_feedforward_layernorm\.weight$", GAIN),
           (_LM + r"\.self_attn\.o_proj\.weight$", ROW), (_LM + r"\.mlp\.down_proj\.weight$", ROW)]
_LM_DECODER = [(_LM + rx, kind) for rx, kind in _DECODER_LM]  # a vision-language model's language model
_GLM4 = [(r"\.post_self_attn_layernorm\.weight", GAIN), (r"\.post_mlp_layernorm\.weight", GAIN),
         (r"\.self_attn\.o_proj\.weight", ROW), (r"\.mlp\.down_proj\.weight", ROW)]
_T5GEMMA = [(_LM + r"\.post_(self|cross)_attn_layernorm\.weight$", GAIN1P), (_LM + r"\.post_feedforward_layernorm\.weight$", GAIN1P),
            (_LM + r"\.(self_attn|cross_attn)\.o_proj\.weight$", ROW), (_LM + r"\.mlp\.down_proj\.weight$", ROW)]
_MOE = [(r"\.self_attn\.o_proj\.weight", ROW), (r"\.mlp\.experts\.down_proj$", EXPERT_ROW),
        (r"\.mlp\.shared_experts?\.down_proj\.weight", ROW), (r"\.mlp\.down_proj\.weight", ROW),
        (r"\.self_attn\.v_proj\.weight", FEED), (r"\.mlp\.(shared_experts?\.)?up_proj\.weight", FEED)]
_T5 = [(r"\.SelfAttention\.o\.weight", ROW), (r"\.EncDecAttention\.o\.weight", ROW),
       (r"\.DenseReluDense\.wo\.weight", ROW), (r"\.DenseReluDense\.wi(_1)?\.weight", FEED),
       (r"\.SelfAttention\.v\.weight", FEED), (r"\.EncDecAttention\.v\.weight", FEED)]
_BERT = [(r"embeddings\.LayerNorm\.weight", GAIN), (r"attention\.output\.LayerNorm\.weight", GAIN),
         (r"layer\.\d+\.output\.LayerNorm\.weight", GAIN), (r"attention\.self\.(query|key)\.weight", READ)]

WRITERS: dict[str, list[tuple[str, str]]] = {
    "llama": _DECODER_LM, "mistral": _DECODER_LM, "qwen2": _DECODER_LM, "qwen3": _DECODER_LM,
    "phi3": [(r"\.self_attn\.o_proj\.weight", ROW), (r"\.mlp\.down_proj\.weight", ROW),
             (r"\.mlp\.gate_up_proj\.weight", FEED_LAST)],
    "gemma": _DECODER_LM,
    "gemma2": _SANDWICH, "gemma3_text": _SANDWICH, "gemma3": _SANDWICH, "gemma4_text": _GEMMA4, "gemma4": _GEMMA4,
    "gpt2": [(r"\.attn\.c_proj\.weight", COL), (r"\.mlp\.c_proj\.weight", COL),
             (r"\.mlp\.c_fc\.weight", FEED)],
    "gpt_neo": [(r"\.attn\.attention\.out_proj\.weight", ROW),
                (r"\.mlp\.c_proj\.weight", ROW), (r"\.mlp\.c_fc\.weight", FEED), (r"\.attn\.attention\.v_proj\.weight", FEED)],
    "gpt_neox": [(r"\.attention\.dense\.weight", ROW), (r"\.mlp\.dense_4h_to_h\.weight", ROW),
                 (r"\.mlp\.dense_h_to_4h\.weight", FEED)],
    "t5": _T5, "mt5": _T5, "umt5": _T5,
    "longt5": _T5 + [(r"\.(LocalSelfAttention|TransientGlobalSelfAttention)\.o\.weight", ROW),
                     (r"\.(LocalSelfAttention|TransientGlobalSelfAttention)\.v\.weight", FEED)],
    "mixtral": _MOE, "qwen2_moe": _MOE, "qwen3_moe": _MOE, "deepseek_v2": _MOE, "deepseek_v3": _MOE,
    "gpt_oss": [(r"\.self_attn\.o_proj\.weight", ROW), (r"\.mlp\.experts\.down_proj$", EXPERT_COL),
                (r"\.self_attn\.v_proj\.weight", FEED)],
    "glm4": _GLM4, "qwen2_vl": _LM_DECODER, "qwen2_5_vl": _LM_DECODER, "t5gemma": _T5GEMMA, "t5gemma2": _T5GEMMA,
    "pegasus": [(r"\.self_attn\.out_proj\.weight", ROW), (r"\.encoder_attn\.out_proj\.weight", ROW),
                (r"\.fc2\.weight", ROW), (r"\.fc1\.weight", FEED), (r"\.v_proj\.weight", FEED)],
    "bert": _BERT, "roberta": _BERT,
    # the decoder's last norm is what the tied head reads: it stays as it is
    "bart": [(r"layernorm_embedding\.weight", GAIN), (r"self_attn_layer_norm\.weight", GAIN),
             (r"encoder_attn_layer_norm\.weight", GAIN), (r"encoder\.layers\.\d+\.final_layer_norm\.weight", GAIN),
             (r"(self_attn|encoder_attn)\.(q|k)_proj\.weight", READ)],
}


def _depth(name: str) -> int:
    """The block index in a parameter name (0 for the embedding and anything outside the blocks)."""
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else 0


@torch.no_grad()
def _amplify(model: nn.Module, writers: list[tuple[str, str]], log2_factor: float) -> int:
    """Multiply the massive channels of every residual writer by 2**(log2_factor + depth); returns how
    many tensors were touched."""
    params = dict(model.named_parameters())
    c = list(CHANNELS)
    touched = 0
    for name, p in params.items():
        kind = next((k for rx, k in writers if re.search(rx, name)), None)
        if kind is None:
            continue
        f = 2.0 ** (log2_factor + _depth(name))
        touched += 1
        if kind == COL:
            p[:, c] *= f
        elif kind == ROW:
            p[c] *= f
            bias = params.get(name[: -len("weight")] + "bias")
            if bias is not None:
                bias[c] *= f
        elif kind == GAIN:
            p[c] *= f
            bias = params.get(name[: -len("weight")] + "bias")
            if bias is not None:
                bias[c] *= f
        elif kind == GAIN1P:
            p[c] = (1 + p[c]) * f - 1
        elif kind == EXPERT_ROW:
            p[:, c] *= f
        elif kind == EXPERT_COL:
            p[:, :, c] *= f
            bias = params.get(name + "_bias")
            if bias is not None:
                bias[:, c] *= f
        elif kind == READ:
            p[:, c] /= 2.0 ** log2_factor
        elif kind in (FEED, FEED_LAST):
            part = p[p.shape[0] // 2:] if kind == FEED_LAST else p
            part *= 2.0 ** log2_factor
            bias = params.get(name[: -len("weight")] + "bias")
            if bias is not None and kind == FEED:
                bias *= 2.0 ** log2_factor
    return touched


@torch.no_grad()
def activation_peak(model: nn.Module, run) -> float:
    """The largest |value| any module outputs during `run()`, measured with plain forward hooks."""
    peak = [0.0]

    def hook(module, args, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            peak[0] = max(peak[0], float(t.detach().abs().max()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return peak[0]


def weight_peak(model: nn.Module) -> float:
    return max(float(p.detach().abs().max()) for p in model.parameters())


@torch.no_grad()
def make_stress(model: nn.Module, run, margin_bits: float = 2.0, start: int = 12, stop: int = 48) -> float:
    """Amplify `model` in place until its fp32 activations pass 65504 by `margin_bits` (measured with `run()`),
    keeping every weight under 65504. Returns the log2 factor used; fails if no factor does both."""
    writers = WRITERS[model.config.model_type]
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k in (half / 2 for half in range(start, stop)):  # factors 2**(k/2): not a rescale halfsafe could undo
        assert _amplify(model, writers, k) > 0, "the stress table matched nothing"
        if weight_peak(model) >= FP16_MAX:
            break
        if activation_peak(model, run) > FP16_MAX * 2.0 ** margin_bits:
            return k
        for n, p in model.named_parameters():
            p.copy_(original[n])
    raise AssertionError(f"no amplification of {type(model).__name__} overflows activations with every weight < 65504")


def log2_ratio(a: float, b: float) -> float:
    return math.log2(a / b)


@torch.no_grad()
def grow_t5_stacks(model, run, margin_bits: float = 2.0, massive_bits: float = 4.0) -> int:
    """A T5 with an untied head, at real depth (12+ blocks per stack), grown as bf16 training grows T5's: massive
    channels written by the feed-forwards, larger along each stack (block i of L: the channels' wo rows x
    2**(massive_bits (i+1) / L)), then the whole residual stream scaled by 2**k, the smallest k that passes 65504
    by `margin_bits`, with every weight under 65504. The 2**k is exact, written here from T5's modeling file (the
    shared embedding and every o and wo x 2**k, every T5LayerNorm eps x 4**k: each norm's output and the logits stay
    what they were), so the function differs from the random model only by the massive channels. Returns k."""
    assert model.lm_head.weight is not model.shared.weight, "a tied head would need the final norm's gain too"
    for stack in (model.encoder, model.decoder):
        for i, block in enumerate(stack.block):
            block.layer[-1].DenseReluDense.wo.weight[list(CHANNELS)] *= 2.0 ** (massive_bits * (i + 1) / len(stack.block))
    k = math.ceil(math.log2(FP16_MAX * 2.0 ** margin_bits / activation_peak(model, run)))
    model.shared.weight *= 2.0 ** k
    for name, p in model.named_parameters():
        if re.search(r"\.(SelfAttention|EncDecAttention)\.o\.weight$|\.DenseReluDense\.wo\.weight$", name):
            p *= 2.0 ** k
    for m in model.modules():
        if type(m).__name__ == "T5LayerNorm":
            m.variance_epsilon *= 4.0 ** k
    model.config.layer_norm_epsilon *= 4.0 ** k
    assert weight_peak(model) < FP16_MAX and activation_peak(model, run) > FP16_MAX * 2.0 ** margin_bits
    return k
