"""T5 v1.0, T5 v1.1 / Flan-T5, mT5, UMT5 (and their encoder-only classes): pre-norm encoder-decoder with
`x * w` RMSNorm (T5LayerNorm: eps in `variance_epsilon`, from config `layer_norm_epsilon`), attention with
no 1/sqrt(d) and an additive relative position bias, one embedding `shared` read by both stacks.

Encoder block (the decoder inserts cross-attention as layer.1, so its feed-forward is layer.2):
  h = h + o(softmax(q(n h) k(n h)^T + bias) v(n h));  h = h + wo(relu(wi(n h)))           (v1.0)
                                                      h = h + wo(gelu(wi_0(n h)) * wi_1(n h))  (gated)
- residual: `shared` feeds both stacks, so encoder and decoder share one scale. Every write into either
  stream (`shared`, each `SelfAttention.o`, `EncDecAttention.o`, `DenseReluDense.wo`) moves with it; every
  norm reads it, so with eps x s**2 no norm output changes, `encoder.final_layer_norm`'s included: what
  every cross-attention k/v reads stays put. A tied head (v1.0; and any T5 built from
  a config in transformers 5, which forces `tie_word_embeddings=True`) reads `shared` x s through
  `decoder.final_layer_norm` (then x d_model**-0.5, a constant), which absorbs 1/s. Checkpoints with their
  own `lm_head` (v1.1, Flan, mT5, UMT5) load untied: nothing more. `encoder/decoder.embed_tokens` are
  separate parameters only when a config unties everything; they then move with `shared`.
- wi/wo (ReLU, v1.0): relu(c x) = c relu(x) for c > 0.
- wi_1/wo (gated): gelu(wi_0 x) * (c wi_1 x) is linear in wi_1. This is the pair that brings Flan-T5's
  gelu*linear product (the input of wo) back under 65504.
- v/o: attention is linear in V. q/k: q x c, k / c leaves QK^T, hence QK^T + bias, unchanged; there is no
  1/sqrt(d) to keep. Cross-attention k/v read the encoder output; its q reads the decoder stream.
transformers keeps `wo` in float32 when loading float16 (`_keep_in_fp32_modules`): see halfsafe.runtime.fp16.
"""

from .builders import (
    T5_DEC_CROSS,
    T5_DEC_FF,
    T5_DEC_SELF,
    T5_DECODER_WRITERS,
    T5_ENC,
    T5_ENC_FF,
    has_decoder,
    t5_stack_pairs,
    weight,
)
from .spec import ONNX_SEQ2SEQ, EpsScope, Family, GroupSpec, Move, OnnxExport, tied_head

T5_ENC_SELF = f"{T5_ENC}.0.SelfAttention"

RESIDUAL = GroupSpec("residual", (
    Move("shared.weight"),
    Move("encoder.embed_tokens.weight", optional=True),
    Move("decoder.embed_tokens.weight", optional=True),
    weight(f"{T5_ENC_SELF}.o"),
    weight(f"{T5_ENC_FF}.wo"),
    weight(f"{T5_DEC_SELF}.o", when=has_decoder),
    weight(f"{T5_DEC_CROSS}.o", when=has_decoder),
    weight(f"{T5_DEC_FF}.wo", when=has_decoder),
    Move("decoder.final_layer_norm.weight", -1, when=tied_head),
), eps_power=2, why="the residual streams of both stacks and every write into them")

FAMILY = Family(
    name="t5",
    model_types=("t5", "mt5", "umt5"),
    groups=(
        RESIDUAL,
        *t5_stack_pairs("enc", {"self": T5_ENC_SELF}, T5_ENC_FF),
        *t5_stack_pairs("dec", {"self": T5_DEC_SELF, "cross": T5_DEC_CROSS}, T5_DEC_FF, when=has_decoder),
    ),
    eps=(EpsScope(("layer_norm_epsilon",)),),
    unfixable="gated wi_0 pre-activations (GELU is not homogeneous); the wi pre-activation of an ungated "
              "non-ReLU feed-forward; raw QK^T + position bias logits under eager attention",
    residual_writers=(T5_DECODER_WRITERS, ("layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo")),  # decoder, encoder
    notes="load float16 checkpoints with halfsafe.runtime.fp16.load_pure_fp16: a plain from_pretrained keeps wo "
          "in float32, which silently makes the residual float32",
    onnx=OnnxExport(ONNX_SEQ2SEQ, ("t5", "mt5")),  # umt5's graphs are untested
)
