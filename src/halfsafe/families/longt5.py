"""LongT5 (`longt5`: google/long-t5-local-base/large, google/long-t5-tglobal-base/large/xl, Pegasus-X-free
summarisers fine-tuned from them): T5 v1.1 with a long-input encoder. Same `x * w` RMSNorm (LongT5LayerNorm, eps
`layer_norm_epsilon` in `variance_epsilon`), same unscaled attention with relative position bias, same `shared`
embedding read by both stacks and (transformers 5 forces `tie_word_embeddings=True`) by the head. The decoder
block is T5's (layer.0.SelfAttention, layer.1.EncDecAttention, layer.2.DenseReluDense); the encoder block's
attention is `layer.0.LocalSelfAttention` (`encoder_attention_type="local"`) or
`layer.0.TransientGlobalSelfAttention` ("transient-global"). No `_keep_in_fp32_modules`: a plain float16 load is
already pure float16.

Everything of families/t5.py holds (residual: `shared`, every `o`/`wo` x s, eps x s**2, a tied head's
`decoder.final_layer_norm` / s; v/o, q/k, wi/wo or wi_1/wo pairs). Local attention scores blocks of q/k
(linear). Transient-global attention also reads the *normed* stream a second way:
  g = global_input_layer_norm(sum over each block of n(h));  side k/v = k(g), v(g)     n = layer.0.layer_norm
That RMSNorm shares the eps, but its input (sums of n(h)) does not scale with the residual. So the residual
group also moves, in every transient-global encoder block: `layer.0.layer_norm` x s (n(h) scales by s),
q, k, v / s (their outputs stay put), and `global_input_layer_norm` x s (its input scaled by s meets eps x s**2,
its output moves by s, which k / s and v / s take back). The q/k pair moves the side keys with the local keys
(both come from k), so QK^T stays; v/o likewise.
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
from .spec import EpsScope, Family, GroupSpec, Move, tied_head

ENC_LOCAL, ENC_TGLOBAL = f"{T5_ENC}.0.LocalSelfAttention", f"{T5_ENC}.0.TransientGlobalSelfAttention"


def local(model) -> bool:
    return model.config.encoder_attention_type == "local"


def tglobal(model) -> bool:
    return model.config.encoder_attention_type == "transient-global"


RESIDUAL = GroupSpec("residual", (
    Move("shared.weight"),
    Move("encoder.embed_tokens.weight", optional=True),
    Move("decoder.embed_tokens.weight", optional=True),
    weight(f"{ENC_LOCAL}.o", when=local),
    weight(f"{ENC_TGLOBAL}.o", when=tglobal),
    weight(f"{T5_ENC}.0.layer_norm", when=tglobal),
    *(weight(f"{ENC_TGLOBAL}.{p}", -1, when=tglobal) for p in "qkv"),
    weight(f"{ENC_TGLOBAL}.global_input_layer_norm", when=tglobal),
    weight(f"{T5_ENC_FF}.wo"),
    weight(f"{T5_DEC_SELF}.o", when=has_decoder),
    weight(f"{T5_DEC_CROSS}.o", when=has_decoder),
    weight(f"{T5_DEC_FF}.wo", when=has_decoder),
    Move("decoder.final_layer_norm.weight", -1, when=tied_head),
), eps_power=2, why="the residual streams of both stacks and every write into them (and the transient-global side "
                    "input, whose norm shares the eps)")

FAMILY = Family(
    name="longt5",
    model_types=("longt5",),
    groups=(
        RESIDUAL,
        *t5_stack_pairs("enc_local", {"self": ENC_LOCAL}, T5_ENC_FF, when=local),
        *t5_stack_pairs("enc_tglobal", {"self": ENC_TGLOBAL}, T5_ENC_FF, when=tglobal),
        *t5_stack_pairs("dec", {"self": T5_DEC_SELF, "cross": T5_DEC_CROSS}, T5_DEC_FF, when=has_decoder),
    ),
    eps=(EpsScope(("layer_norm_epsilon",)),),
    residual_writers=(T5_DECODER_WRITERS,
                      ("layer.0.LocalSelfAttention.o", "layer.1.DenseReluDense.wo"),  # encoder, local attention
                      ("layer.0.TransientGlobalSelfAttention.o", "layer.1.DenseReluDense.wo")),  # transient-global
    unfixable="gated wi_0 pre-activations (GELU is not homogeneous); the wi pre-activation of an ungated "
              "non-ReLU feed-forward; raw QK^T + position bias logits under eager attention",
)
