"""Pegasus: pre-norm encoder-decoder, nn.LayerNorm with weight and bias and a hard-coded eps of 1e-5, one
embedding `shared` read by both stacks (x sqrt(d) when `scale_embedding`) and, tied, by the LM head (plus
the `final_logits_bias` buffer); sinusoidal positions.

  encoder: h = shared[ids] * scale + pos;  per layer h += out(attn(n h)); h += fc2(act(fc1(n h)));  LN(h)
  decoder: the same with h += out(attn(q(n h), k enc, v enc)) (encoder_attn) between the two; LN(h)

- residual: as in Llama, the stream of each stack is read only through LayerNorms, so every write into it
  moves by s: `shared` (and the stacks' own embed_tokens when untied; embed_scale is a constant),
  both `embed_positions` tables, every self_attn.out_proj, encoder_attn.out_proj and fc2 (weight and
  bias). `embed_positions` is a frozen nn.Parameter (requires_grad False) holding the sinusoids: it is
  saved with the checkpoint and loaded back as saved (checked in transformers 5), so it can carry s.
  The encoder and decoder share one s (one `shared`). The final `encoder.layer_norm` puts out what it did,
  so the cross-attention k/v need nothing; `decoder.layer_norm` does too, so only a tied head (which reads
  `shared` x s) needs it to absorb 1/s (weight and bias). An untied lm_head needs nothing.
- Approximate, not exact: every LayerNorm has eps 1e-5 fixed in the code (nn.LayerNorm's default, not a
  config field, so no checkpoint can move it by s**2). A norm's output changes by about
  (1/s**2 - 1) eps / (2 var) relative, var being the per-token variance of the stream it reads:
  negligible on the streams a plan lowers (s < 1 only where they near float16's range). Measured on the
  tiny random model, whose stream has a per-token variance of only 0.2-0.3 (sinusoids plus small
  embeddings): s = 1/2 changes the output by 3.8e-5, s = 1/4 by 1.9e-4, s = 1/8 by 7.9e-4, s = 2..8 by
  about 1e-5; with the eps set to 0 every plan is exact to the bit
  (tests/test_families.py::test_fixed_norm_eps_is_the_only_error). No released checkpoint was measured
  (none is available offline); the conversion report's fp32_output_change measures the effect on the
  calibration text.
- qk / vo per attention (enc_, dec_ self-attention, cross_ encoder_attn); fc1 x c with fc2 / c when the
  activation is relu (relu(c x) = c relu(x)).
The encoder layer clamps float16 hidden states to +-64504 after every layer; a plan keeps them below.
The decoder-only PegasusForCausalLM is laid out differently (no `shared`) and fails in groups.expand.
"""

from .builders import BART_DECODER_WRITERS, BART_ENCODER_WRITERS, bart_embeddings, bart_pairs, linear, norm
from .spec import ONNX_SEQ2SEQ, EpsScope, Family, GroupSpec, OnnxExport, tied_head

M = "model"
_E, _D = f"{M}.encoder.layers.{{i}}", f"{M}.decoder.layers.{{i}}"

FAMILY = Family(
    name="pegasus",
    model_types=("pegasus",),
    groups=(
        GroupSpec("residual", (
            *bart_embeddings(),
            *linear(f"{_E}.self_attn.out_proj"), *linear(f"{_E}.fc2"),
            *linear(f"{_D}.self_attn.out_proj"), *linear(f"{_D}.encoder_attn.out_proj"), *linear(f"{_D}.fc2"),
            *norm(f"{M}.decoder.layer_norm", -1, when=tied_head),
        ), why="both residual streams and every write into them; a tied head is undone in decoder.layer_norm"),
        *bart_pairs(),
    ),
    unfixable=("fc1 pre-activations unless the activation is relu; raw QK^T logits under eager attention; "
               "the residual scale is approximate (LayerNorm eps 1e-5 is fixed in the code)"),
    residual_writers=(BART_DECODER_WRITERS, BART_ENCODER_WRITERS),
    eps=(EpsScope((), fixed_value=1e-5),),  # nn.LayerNorm's default, not in the config: no checkpoint can move it
    notes="LayerNorm eps is hard-coded (1e-5), so the residual scale is exact only up to eps / s**2",
    onnx=OnnxExport(ONNX_SEQ2SEQ),
)
