"""BART: post-norm encoder-decoder, nn.LayerNorm with weight and bias and a hard-coded eps of 1e-5, GELU MLP,
separate q/k/v/out projections (all biased), learned positions, one embedding `shared` read by both
stacks (x sqrt(d) when `scale_embedding`) and, tied, by the LM head (plus the `final_logits_bias` buffer).

  encoder: h = LN_emb(shared[ids] * scale + pos);  per layer:
           y = LN_sa(out(attn(q h, k h, v h)) + h);  h = LN_f(fc2(gelu(fc1 y)) + y)
  decoder: the same with, between the two, z = LN_ca(out(attn(q y, k enc, v enc)) + y) (encoder_attn)

As in BERT (families/bert.py), no scale runs through the model: each LayerNorm's output moves by its own c
(weight and bias x c), every Linear reading it by weight / c (its bias stays), and the branch output added
to it before the next LayerNorm (weight and bias) x c, so that the next LayerNorm reads c times its old
input and puts out what it did, up to its eps. That eps (1e-5) is nn.LayerNorm's default, not a config
field, so no checkpoint can move it: LN(c x) behaves as LN(x) with eps / c**2, a relative change of about
(1/c**2 - 1) eps / (2 var) in the norm's output, var being its input's variance per token. Negligible where
a plan lowers c (that norm's input nears float16's range); on the tiny random model (LayerNorm inputs of
variance ~1) one group at c = 1/8 changes the output by up to 3.0e-4, at c = 1/2 by 1.4e-5, and with the
eps set to 0 every plan is exact to the bit (tests/test_families.py::test_fixed_norm_eps_is_the_only_error).
Groups, per stack (`enc_`/`dec_`), each named after the LayerNorm whose output it scales:
- *_ln_emb: layernorm_embedding, read by layer 0's self-attention (q/k/v / c, out_proj x c).
- enc_ln_attn / dec_ln_cross (per layer): the norm before the MLP: fc1 / c, fc2 x c.
- dec_ln_self (per layer): self_attn_layer_norm, read by encoder_attn.q_proj / c, encoder_attn.out_proj x c.
- *_ln_ffn (per layer i < n-1, `{i+1}`): final_layer_norm, read by layer i+1's self-attention.
- enc_out: the last encoder final_layer_norm, i.e. the encoder output, read only by every decoder layer's
  encoder_attn k/v (/ c). `encoder_last_hidden_state` in the output moves with it, as hidden states do.
- dec_out: the last decoder final_layer_norm, in classes whose reader of it is an ordinary Linear (an untied
  lm_head, the classification head's dense, qa_outputs). Not with a tied head (it is `shared`, which the
  embeddings also read) and never in the bare model, whose output it is.
- qk / vo pairs per attention (enc_, dec_ self-attention, cross_ encoder_attn); fc pairs with relu only.
No group moves the embeddings: scaling `shared` and the position tables would scale layernorm_embedding's
input, whose per-token variance is tiny (~6e-4 on the tiny model, ~1e-3 for weights of std 0.02), so its
eps would not be negligible (c = 1/8 changed the tiny model's output by 2.3%); an embedding table never
nears float16's range anyway. The decoder-only BartForCausalLM is laid out differently (no `shared`,
no encoder) and fails in groups.expand. The encoder layer clamps float16 hidden states only when they
are already non-finite.
"""

from .builders import BART_DECODER_WRITERS, BART_ENCODER_WRITERS, bart_pairs, class_in, linear, norm
from .spec import ONNX_SEQ2SEQ, EpsScope, Family, GroupSpec, Move, OnnxExport, StressHint, untied_head

M = "model"
ENC, DEC = f"{M}.encoder.layers", f"{M}.decoder.layers"

def _self_attn_reads(layer: str) -> tuple[Move, ...]:
    return (*(Move(f"{layer}.self_attn.{p}_proj.weight", -1) for p in "qkv"), *linear(f"{layer}.self_attn.out_proj"))


_HEADS = {"BartForConditionalGeneration": "lm_head", "BartForSequenceClassification": "classification_head.dense",
          "BartForQuestionAnswering": "qa_outputs"}
_E, _D, _EN, _DN = f"{ENC}.{{i}}", f"{DEC}.{{i}}", f"{ENC}.{{i+1}}", f"{DEC}.{{i+1}}"
_LAST_DEC_NORM = f"{DEC}.{{last}}.final_layer_norm"


def _dec_out(model) -> bool:
    name = type(model).__name__
    return name in _HEADS and (name != "BartForConditionalGeneration" or untied_head(model))


FAMILY = Family(
    name="bart",
    model_types=("bart",),
    groups=(
        GroupSpec("enc_ln_emb", (*norm(f"{M}.encoder.layernorm_embedding"), *_self_attn_reads(f"{ENC}.0")),
                  why="encoder layernorm_embedding, read by encoder layer 0"),
        GroupSpec("enc_ln_attn", (*norm(f"{_E}.self_attn_layer_norm"), Move(f"{_E}.fc1.weight", -1), *linear(f"{_E}.fc2")),
                  per_block=True, why="the norm before the MLP: fc1 / c, fc2 x c"),
        GroupSpec("enc_ln_ffn", (*norm(f"{_E}.final_layer_norm"), *_self_attn_reads(_EN)), per_block=True,
                  why="a layer's final norm, read by the next layer"),
        GroupSpec("enc_out", (*norm(f"{ENC}.{{last}}.final_layer_norm"),
                              *(Move(f"{_D}.encoder_attn.{p}_proj.weight", -1) for p in "kv")),
                  why="the encoder output, read by every cross-attention's k/v"),
        GroupSpec("dec_ln_emb", (*norm(f"{M}.decoder.layernorm_embedding"), *_self_attn_reads(f"{DEC}.0")),
                  why="decoder layernorm_embedding, read by decoder layer 0"),
        GroupSpec("dec_ln_self", (*norm(f"{_D}.self_attn_layer_norm"), Move(f"{_D}.encoder_attn.q_proj.weight", -1),
                                  *linear(f"{_D}.encoder_attn.out_proj")), per_block=True,
                  why="the self-attention norm, read by the cross-attention query"),
        GroupSpec("dec_ln_cross", (*norm(f"{_D}.encoder_attn_layer_norm"), Move(f"{_D}.fc1.weight", -1), *linear(f"{_D}.fc2")),
                  per_block=True, why="the norm before the MLP: fc1 / c, fc2 x c"),
        GroupSpec("dec_ln_ffn", (*norm(f"{_D}.final_layer_norm"), *_self_attn_reads(_DN)), per_block=True,
                  why="a layer's final norm, read by the next layer"),
        GroupSpec("dec_out", (*norm(_LAST_DEC_NORM),
                              *(Move(f"{head}.weight", -1, when=class_in((cls,))) for cls, head in _HEADS.items())),
                  when=_dec_out, why="the decoder output, read only by the head's Linear"),
        *bart_pairs(),
    ),
    unfixable=("fc1 pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention; "
               "a LayerNorm's input only moves with the LayerNorm output before it"),
    residual_writers=(BART_DECODER_WRITERS, BART_ENCODER_WRITERS),
    eps=(EpsScope((), fixed_value=1e-5),),  # nn.LayerNorm's default, not in the config: no checkpoint can move it
    notes="LayerNorm eps is hard-coded (1e-5): each norm whose input moves is matched only approximately",
    # the streams: the embedding norms' outputs, then each sub-layer's; the decoder's final norms are left out (the
    # last is what the tied head reads). Every attention's query and key read a stream directly.
    stress=StressHint(
        norms=(f"{M}.encoder.layernorm_embedding", f"{_E}.self_attn_layer_norm", f"{_E}.final_layer_norm",
               f"{M}.decoder.layernorm_embedding", f"{_D}.self_attn_layer_norm", f"{_D}.encoder_attn_layer_norm"),
        reads=tuple(f"{layer}.{attn}.{p}_proj" for layer, attn in ((_E, "self_attn"), (_D, "self_attn"), (_D, "encoder_attn"))
                    for p in "qk")),
    onnx=OnnxExport(ONNX_SEQ2SEQ),
)
