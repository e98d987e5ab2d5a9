"""T5Gemma 2 (`t5gemma2`: google/t5gemma-2-270m-270m, -1b-1b, -4b-4b): an encoder-decoder built from Gemma 3
blocks, with a SigLIP vision tower in the encoder. RMSNorm is Gemma's `x * (1 + w)` in fp32 (T5Gemma2RMSNorm,
eps `rms_norm_eps` of `config.encoder.text_config` and `config.decoder`); sandwich norms as in T5Gemma; per-head
q/k norms as in Gemma 3. One embedding table (x sqrt(hidden), plus an `eoi_embedding` written, unscaled, at
end-of-image tokens) is shared by the encoder, the decoder and the head. The decoder has no separate
cross-attention: its `self_attn` (merged attention) attends over [its own keys | keys of the encoder output],
both from the same k_proj and k_norm, values from the same v_proj.
Encoder input: embed(ids), with image tokens replaced by the projector's output
  mm(x) = mm_soft_emb_norm(avgpool(vision_tower(pixels))) @ mm_input_projection_weight
(mm_soft_emb_norm is a (1+w) RMSNorm with the *vision* config's eps).

- residual: both streams under one scale s (they share the embedding). Writes: the embedding table and
  `eoi_embedding`, `mm_input_projection_weight` (image embeddings), the post-branch norm gains (s(1+w)-1).
  o_proj, down_proj, q_proj and k_proj move by s as well, so every norm that shares the eps (post-branch norms,
  q/k norms) reads an input scaled by s and the eps moves by s**2 exactly. The encoder's final norm puts out what
  it did, so the decoder's cross keys (k_norm(k_proj(enc)) with k_proj x s: exact) and values are unchanged.
  Tied head: `model.decoder.norm` (1+w)/s - 1. The vision tower and the projector's norm keep their eps
  (`keep` in its EpsScope; their 1e-6 equals the text eps in every release).
- per block (encoder and decoder): v/o (v_proj x c, o_proj columns / c; the merged attention's self and cross
  values both come from v_proj), up/down (gelu(gate) * up is linear in up). No q/k pair, as in Gemma 3: q and k
  leave their norms already bounded, and moving the (1+w) gains of q_norm/k_norm by c and 1/c is not invertible
  bit for bit in fp32 where a gain w is tiny ((1+w)/c - 1 drops w's low bits).
- vision tower (SigLIP encoder layers): v/o (v_proj weight and bias x c, out_proj / c) and q/k (q_proj x c, k_proj
  / c, weights and biases). Its residual stream is not moved here: its LayerNorms' eps is the vision config's
  `layer_norm_eps`, which this family's one eps field cannot move apart from the text eps.
Trap (as Gemma 2/3): s(1+w)-1 stored in 16 bits rounds, more as s shrinks; the planner measures it.
"""

from .builders import SIGLIP_BLOCK_WRITERS, T5GEMMA_SELF_WRITERS, biased, gain, t5gemma_up_down
from .spec import EpsScope, Family, GroupSpec, Move, StressHint, tied_head

ENC, DEC = "model.encoder.text_model.layers.{i}", "model.decoder.layers.{i}"
EMB = "model.encoder.text_model.embed_tokens"
VIS = "model.encoder.vision_tower"
V = f"{VIS}.encoder.layers.{{i}}.self_attn"


def _stack_writes(layer: str) -> tuple[Move, ...]:
    return (
        gain(f"{layer}.post_self_attn_layernorm"),
        gain(f"{layer}.post_feedforward_layernorm"),
        *biased(f"{layer}.self_attn.o_proj"),
        *biased(f"{layer}.self_attn.q_proj"),  # read by q_norm, which shares the eps
        *biased(f"{layer}.self_attn.k_proj"),  # read by k_norm
        *biased(f"{layer}.mlp.down_proj"),
    )


def _pairs(stack: str, layer: str) -> tuple[GroupSpec, ...]:
    attn = f"{layer}.self_attn"
    return (
        GroupSpec(f"{stack}_vo", (*biased(f"{attn}.v_proj"), Move(f"{attn}.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: v_proj x c, o_proj columns / c"),
        t5gemma_up_down(stack, layer),
    )


FAMILY = Family(
    name="t5gemma2",
    model_types=("t5gemma2",),
    groups=(
        GroupSpec("residual", (
            Move(f"{EMB}.weight"),
            Move(f"{EMB}.eoi_embedding"),
            Move("model.decoder.embed_tokens.weight", optional=True),  # the same tensor unless a config unties it
            Move("model.decoder.embed_tokens.eoi_embedding", optional=True),
            Move("model.encoder.multi_modal_projector.mm_input_projection_weight"),
            *_stack_writes(ENC),
            *_stack_writes(DEC),
            gain("model.decoder.norm", -1, when=tied_head),
        ), eps_power=2, why="both residual streams and every write into them, image embeddings included"),
        *_pairs("enc", ENC),
        *_pairs("dec", DEC),
        GroupSpec("vis_vo", (*biased(f"{V}.v_proj"), Move(f"{V}.out_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: v_proj x c, out_proj columns / c"),
        GroupSpec("vis_qk", (*biased(f"{V}.q_proj"), *biased(f"{V}.k_proj", -1)), per_block=True,
                  why="QK^T is unchanged by q_proj x c, k_proj / c"),
    ),
    eps=(EpsScope(("rms_norm_eps",), keep=(VIS, "model.encoder.multi_modal_projector")),),
    residual_writers=(T5GEMMA_SELF_WRITERS, SIGLIP_BLOCK_WRITERS),  # encoder and decoder (merged attention), vision tower
    unfixable=("gate_proj pre-activations (GELU is not homogeneous); the vision tower's residual stream (its "
               "LayerNorm eps is a separate config field) and fc1 pre-activations (GELU); raw QK^T logits under "
               "eager attention"),
    one_plus_norm_gains=True,  # T5Gemma2RMSNorm: x * (1 + w), as Gemma's
    stress=StressHint(towers=(VIS,)),  # the stress blows up the language model's stream only
)
