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
transformers keeps `wo` in float32 when loading float16 (`_keep_in_fp32_modules`): see halfsafe.runtime.
"""

from .spec import Family, GroupSpec, Move, tied_head

ENC, DEC = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
ENC_SELF, ENC_FF = f"{ENC}.0.SelfAttention", f"{ENC}.1.DenseReluDense"
DEC_SELF, DEC_CROSS, DEC_FF = f"{DEC}.0.SelfAttention", f"{DEC}.1.EncDecAttention", f"{DEC}.2.DenseReluDense"


def has_decoder(model) -> bool:
    """False for the encoder-only classes (T5EncoderModel, the usual text encoder of diffusion models)."""
    return getattr(model, "decoder", None) is not None


def relu_ff(model) -> bool:
    return not model.config.is_gated_act and model.config.dense_act_fn == "relu"


def gated_ff(model) -> bool:
    return model.config.is_gated_act


def _w(module: str, power: int = 1, when=None) -> Move:
    return Move(f"{module}.weight", power, when=when)


def _all(*conditions):
    conditions = [c for c in conditions if c is not None]
    return lambda model: all(c(model) for c in conditions)


def _stack_specs(stack: str, attentions: dict[str, str], ff: str, when=None) -> tuple[GroupSpec, ...]:
    """The pairs inside one stack's blocks: v/o and q/k per attention module, and the feed-forward pair."""
    specs = []
    for kind, attn in attentions.items():
        specs += [
            GroupSpec(f"{stack}_{kind}_vo", (_w(f"{attn}.v"), _w(f"{attn}.o", -1)), per_block=True, when=when,
                      why="attention is linear in V: v x c, o columns / c"),
            GroupSpec(f"{stack}_{kind}_qk", (_w(f"{attn}.q"), _w(f"{attn}.k", -1)), per_block=True, when=when,
                      why="QK^T (and so QK^T + position bias) is unchanged by q x c, k / c"),
        ]
    specs += [
        GroupSpec(f"{stack}_wi_wo", (_w(f"{ff}.wi"), _w(f"{ff}.wo", -1)), per_block=True, when=_all(when, relu_ff),
                  why="ReLU is positively homogeneous: wi x c, wo / c"),
        GroupSpec(f"{stack}_wi1_wo", (_w(f"{ff}.wi_1"), _w(f"{ff}.wo", -1)), per_block=True,
                  when=_all(when, gated_ff), why="the gated product is linear in wi_1: wi_1 x c, wo / c"),
    ]
    return tuple(specs)


RESIDUAL = GroupSpec("residual", (
    Move("shared.weight"),
    Move("encoder.embed_tokens.weight", optional=True),
    Move("decoder.embed_tokens.weight", optional=True),
    _w(f"{ENC_SELF}.o"),
    _w(f"{ENC_FF}.wo"),
    _w(f"{DEC_SELF}.o", when=has_decoder),
    _w(f"{DEC_CROSS}.o", when=has_decoder),
    _w(f"{DEC_FF}.wo", when=has_decoder),
    Move("decoder.final_layer_norm.weight", -1, when=tied_head),
), eps_power=2, why="the residual streams of both stacks and every write into them")

FAMILY = Family(
    name="t5",
    model_types=("t5", "mt5", "umt5"),
    groups=(
        RESIDUAL,
        *_stack_specs("enc", {"self": ENC_SELF}, ENC_FF),
        *_stack_specs("dec", {"self": DEC_SELF, "cross": DEC_CROSS}, DEC_FF, when=has_decoder),
    ),
    eps_attrs=("layer_norm_epsilon",),
    unfixable="gated wi_0 pre-activations (GELU is not homogeneous); the wi pre-activation of an ungated "
              "non-ReLU feed-forward; raw QK^T + position bias logits under eager attention",
    fp32_modules_to_release=("wo",),
    notes="load float16 checkpoints with halfsafe.runtime.load_pure_fp16: a plain from_pretrained keeps wo "
          "in float32, which silently makes the residual float32",
)
