"""Gemma 3n (`gemma3n`: Gemma 3n E2B/E4B, `Gemma3nForConditionalGeneration`): refused, for the reason below.

What is exact (derived from transformers' modeling_gemma3n.py): its RMSNorms compute x * w (no (1+w)), and the
text decoder is homogeneous in its four AltUp streams together: scale the embedding by s and every norm input
scales by s if the shared rms_norm_eps moves by s**2 and these gains/weights move by s: input_layernorm (it
feeds Laurel's skip; q/k/v are re-normalised by q_norm/k_norm/v_norm), post_laurel_norm, o_proj (v_norm has no
gain, so the attention output does not carry the scale), post_attention_layernorm, down_proj,
post_feedforward_layernorm, per_layer_projection, post_per_layer_input_norm; per_layer_input_gate (read through
GELU) or altup.correct_output_scale by 1/s; a tied head's final norm by 1/s. AltUp's predict/correct coefficients
read router_norm outputs and stay put; the per-layer embeddings and activation sparsity read normalised inputs.
Only AltUp's magnitude matching (altup_projections / altup_unembed_projections: sqrt(clamp(mean(x**2), min=1e-5)),
a constant in the code) breaks homogeneity, where a stream's mean square falls below 1e-5 / s**2. Checked on a
tiny random Gemma3nForCausalLM (tied, activation sparsity on in layer 0): logits unchanged (0) for s = 2**-3 and
2**3, off by 7e-2 (relative) for s = 2**-6, where the clamp binds.

What is not: image and audio tokens enter the residual stream through Gemma3nMultimodalEmbedder, whose last
step is an RMSNorm without a gain (embedding_post_projection_norm, with_scale=False): those writes have RMS 1
whatever the weights, so no rescale can make them follow the residual scale. Every public Gemma 3n checkpoint is
this multimodal model, so `gemma3n` is refused rather than converted into a model that changes on images/audio.
A text-only `gemma3n_text` model has no such write; it is not covered yet (the moves above, exact up to the clamp).
"""

REFUSED = {
    "gemma3n": "gemma3n cannot be rescaled exactly: its vision and audio embedders (embed_vision, embed_audio) write "
               "image/audio tokens into the residual stream through an RMSNorm with no gain (embedding_post_projection_norm, "
               "with_scale=False), so those writes keep RMS 1 whatever the weights and cannot follow a residual scale",
    "gemma3n_text": "gemma3n_text is not covered yet: its AltUp streams admit one residual scale, exact except where "
                    "AltUp's hard-coded 1e-5 magnitude clamp binds (see families/gemma3n.py); no family data is written for it",
}
