"""Two tiny models that overflow float16 the way Gemma-family RL does, for the tests of RL in fp16 (TRL's GRPO
training a converted folder under fp16 autocast with loss scaling, rollouts by vLLM).

The overflow they copy (unsloth-zoo#600, GRPO of Gemma 4 E2B in fp16): the first non-finite tensor is the output
of `layers.0.mlp.down_proj`, after gate_proj and up_proj saturate on a few channels. Here:
- one residual channel (`CHANNEL`) is massive for *every* token: the embedding's column is a constant, as real
  models' massive activations are (so sampled completions overflow as well as any prompt); the attention and the
  tied head read it damped (input_layernorm's and the final norm's gains on it), as trained models keep their
  massive channels out of attention and the logits;
- pre_feedforward_layernorm normalises that channel to about sqrt(hidden), and a few intermediate rows (`ROWS`)
  of gate_proj and up_proj read it with large weights: gate and up put out hundreds, their gated product tens of
  thousands (under 65504), and down_proj sums those rows into the massive channel past 65504 by 1.4 to 1.6 bits;
- later blocks are milder (`LATER_BITS` less per block).
Every weight stays far under 65504 and a power-of-two multiple of a bfloat16 value; fp32 is finite throughout,
since post_feedforward_layernorm normalises what down_proj writes. halfsafe's residual group (down_proj moves
with the stream, the eps with its square) brings it back into range exactly.

The backward's cost of that: every gradient with respect to a tensor the residual group scales by s grows by 1/s,
the tied embedding's most (it is also the head, reading the final norm whose gain moved by 1/s). Measured at loss
scale 2**16 on three 8 x 32-token batches, the largest gradient with residual exponent -3, -4, -5 (the plans halfsafe
finds equal in KL here, and chooses among by that KL): Gemma 3 5400-7000, 10800-14000, 21700-27900; Gemma 4
10200-15900, 16700-20400, 33200-40800. A deeper plan would overflow the backward.

Both use head_dim 32, as tests/vllmenv.py's tiny models do (vLLM's CPU attention has no 16), and the character
tokenizer of tests/jsclient.py over the whole vocabulary, so `save` makes a folder vLLM and TRL load offline.
"""

from __future__ import annotations

import tempfile

import torch
from jsclient import save_char_tokenizer
from stress import CHANNELS, FP16_MAX
from transformers import Gemma4TextConfig, PreTrainedModel
from vllmenv import randomised, tiny_for_vllm

CHANNEL = CHANNELS[0]  # the massive residual channel
ROWS = (5, 37, 70, 101)  # the intermediate rows of gate_proj/up_proj that read it (inside 128, the narrowest MLP)
EMBED = 4.0  # every token's embedding on CHANNEL (x sqrt(hidden) = 32 in the stream: it dominates every norm)
GATE, UP, DOWN = 32.0, 16.0, 1.5  # gate/up rows' weight on CHANNEL, down_proj's columns ROWS on CHANNEL (block 0)
# Every block's linear weights x 4: std 0.08, about 1/sqrt(fan-in) as trained weights. At tests/tiny's 0.02 the
# attention branches put out so little that the norms reading them multiply the gradient, and the converted Gemma 4's
# backward at loss scale 2**16 came within 0.05 bit of 65504 (0.68 bit with the x 4).
WIDEN = 4.0
LATER_BITS = 1.0  # each later block's gate and up weights are 2**-(LATER_BITS / 2) smaller: half the product


def gemma3_down_proj(seed: int = 0) -> tuple[PreTrainedModel, object]:
    """A Gemma 3 text model (Gemma3ForCausalLM, 2 blocks, sliding then full attention, tied head) whose block 0
    down_proj overflows float16; and its tokenizer."""
    model = tiny_for_vllm("gemma3_text", seed)
    _massive_mlp(model, one_plus=True)
    return model, tokenizer(model)


def gemma4_e2b_like(seed: int = 0) -> tuple[PreTrainedModel, object]:
    """Gemma 4 E2B in small (Gemma4ForCausalLM): per-layer input embeddings, the last 2 of 4 blocks reusing the
    K/V of the first two (one sliding, one full) with a double-wide MLP, final logit soft-capping, tied head;
    block 0's down_proj overflows float16. And its tokenizer."""
    config = Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, global_head_dim=32, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
        pad_token_id=0, attn_implementation="eager", architectures=["Gemma4ForCausalLM"])
    model = randomised(config, seed)
    _massive_mlp(model, one_plus=False)
    return model, tokenizer(model)


@torch.no_grad()
def _massive_mlp(model: PreTrainedModel, one_plus: bool) -> None:
    """The stress of the module docstring, in place. `one_plus`: the norms compute x * (1 + w) (Gemma 3)."""

    def gain(norm, value):  # the norm's effective gain on CHANNEL
        norm.weight[CHANNEL] = value - 1 if one_plus else value

    base = model.model
    base.embed_tokens.weight[:, CHANNEL] = EMBED
    gain(base.norm, 0.0)  # the tied head: the constant channel would only shift every logit alike
    rows = list(ROWS)
    for i, layer in enumerate(base.layers):
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight *= WIDEN
        gain(layer.input_layernorm, 1 / 8)
        f = 2.0 ** (-LATER_BITS * i / 2)
        layer.mlp.gate_proj.weight[rows, CHANNEL] = GATE * f
        layer.mlp.up_proj.weight[rows, CHANNEL] = UP * f
        layer.mlp.down_proj.weight[CHANNEL, rows] = DOWN
    assert all(float(p.detach().abs().max()) < FP16_MAX / 1024 for p in model.parameters())


def tokenizer(model: PreTrainedModel):
    """tests/jsclient.py's character tokenizer over `model`'s whole vocabulary, loaded (as `save` writes it)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        save_char_tokenizer(folder, model.config)
        return AutoTokenizer.from_pretrained(folder)


def save(model: PreTrainedModel, folder) -> None:
    """`model` (float32) and its tokenizer into `folder`, as vLLM and TRL load a model offline."""
    model.save_pretrained(folder)
    save_char_tokenizer(folder, model.config)


def _nonfinite(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.is_floating_point() and not bool(torch.isfinite(out).all())
    if isinstance(out, dict):
        out = list(out.values())
    return isinstance(out, (tuple, list)) and any(_nonfinite(o) for o in out)


@torch.no_grad()
def first_nonfinite(model: PreTrainedModel, ids: torch.Tensor, autocast: bool = True) -> str | None:
    """The first module, in the order modules finish their forward, whose output holds a non-finite value when
    `model` runs `ids` (under fp16 autocast on the CPU if `autocast`, else in the model's own dtype); None if all
    are finite. A module whose *input* was already non-finite (the overflow happened in an operation between
    modules, such as the MLP's gated product) is named with ":input" after it."""
    found: list[str] = []

    def hook(name):
        def check(module, args, out):
            if not found and _nonfinite(out):
                found.append(f"{name}:input" if _nonfinite(list(args)) else name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
