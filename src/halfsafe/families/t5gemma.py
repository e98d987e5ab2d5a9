"""T5Gemma (`t5gemma`: google/t5gemma-s-s, -b-b, -l-l, -ml-ml, -xl-xl, -2b-2b, -9b-2b, -9b-9b, each -prefixlm /
-ul2 and -it): an encoder-decoder built from Gemma 2 blocks. RMSNorm is Gemma's `x * (1 + w)` computed in fp32
(T5GemmaRMSNorm, eps `rms_norm_eps` in `eps`, one per stack config: `config.encoder`, `config.decoder`); every
sublayer is sandwiched, `h = h + post_norm(branch(pre_norm(h)))`:
  encoder layer: self-attention (bidirectional), MLP;   decoder layer: self-attention, cross-attention, MLP.
Embeddings (one table per stack) are multiplied by sqrt(hidden) inside the model (a constant). Attention uses
`query_pre_attn_scalar**-0.5` and soft-caps its logits (tanh(x / 50) * 50); the LM head (`lm_head.out_proj`,
tied to `model.decoder.embed_tokens` in every released checkpoint) soft-caps the logits at 30.

- residual: both streams under one scale s (they share no tensor, but both stacks' eps move together under the
  family's one eps field). The writes are the embeddings and the post-branch norms, whose gains become
  s(1+w)-1; o_proj (self and cross) and down_proj move by s too, so every norm, post-branch norms included, reads
  an input scaled by s and both eps move by s**2 exactly. The encoder's final norm puts out what it did, so every
  cross-attention k/v reads an unchanged encoder output. A tied head reads `model.decoder.norm`: (1+w)/s - 1.
  Soft-capping sees unchanged logits.
- per block, per attention (encoder self, decoder self, decoder cross): v/o (v x c, o columns / c) and q/k
  (q x c, k / c: RoPE is linear, QK^T and so the soft-cap input unchanged; cross-attention k reads the encoder
  output); per MLP: up/down (gelu(gate) * up is linear in up).
Trap (as Gemma 2): s(1+w)-1 stored in 16 bits rounds, more as s shrinks; the planner measures it.
The encoder-only class (T5GemmaEncoderModel, `encoder.` without `model.`) is laid out differently and fails in
groups.expand.
"""

from .builders import T5GEMMA_SELF_WRITERS, biased, gain, t5gemma_up_down
from .spec import EpsScope, Family, GroupSpec, Move

ENC, DEC = "model.encoder.layers.{i}", "model.decoder.layers.{i}"


def decoder_tied_head(model) -> bool:
    """The head is the decoder's embedding (T5Gemma ties to the decoder's table, not the encoder's)."""
    head, decoder = model.get_output_embeddings(), getattr(getattr(model, "model", None), "decoder", None)
    return head is not None and decoder is not None and head.weight is decoder.embed_tokens.weight


def attention_pairs(stack: str, attn: str) -> tuple[GroupSpec, ...]:
    return (
        GroupSpec(f"{stack}_vo", (*biased(f"{attn}.v_proj"), Move(f"{attn}.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: v x c, o_proj columns / c"),
        GroupSpec(f"{stack}_qk", (*biased(f"{attn}.q_proj"), *biased(f"{attn}.k_proj", -1)), per_block=True,
                  why="QK^T (so the soft-capped logits) is unchanged by q x c, k / c (RoPE is linear)"),
    )


RESIDUAL = GroupSpec("residual", (
    Move("model.encoder.embed_tokens.weight"),
    gain(f"{ENC}.post_self_attn_layernorm"),
    gain(f"{ENC}.post_feedforward_layernorm"),
    *biased(f"{ENC}.self_attn.o_proj"),
    *biased(f"{ENC}.mlp.down_proj"),
    Move("model.decoder.embed_tokens.weight"),
    gain(f"{DEC}.post_self_attn_layernorm"),
    gain(f"{DEC}.post_cross_attn_layernorm"),
    gain(f"{DEC}.post_feedforward_layernorm"),
    *biased(f"{DEC}.self_attn.o_proj"),
    *biased(f"{DEC}.cross_attn.o_proj"),
    *biased(f"{DEC}.mlp.down_proj"),
    gain("model.decoder.norm", -1, when=decoder_tied_head),
), eps_power=2, why="both residual streams and every write into them (post-branch norms and their inputs)")

FAMILY = Family(
    name="t5gemma",
    model_types=("t5gemma",),
    groups=(
        RESIDUAL,
        *attention_pairs("enc_self", f"{ENC}.self_attn"),
        *attention_pairs("dec_self", f"{DEC}.self_attn"),
        *attention_pairs("dec_cross", f"{DEC}.cross_attn"),
        t5gemma_up_down("enc", ENC),
        t5gemma_up_down("dec", DEC),
    ),
    eps=(EpsScope(("rms_norm_eps",)),),
    residual_writers=(("post_self_attn_layernorm", "post_cross_attn_layernorm", "post_feedforward_layernorm"),  # decoder
                      T5GEMMA_SELF_WRITERS),  # encoder
    unfixable="gate_proj pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention "
              "(soft-capped at 50 after the matmul)",
    one_plus_norm_gains=True,  # T5GemmaRMSNorm: x * (1 + w), as Gemma's
)
