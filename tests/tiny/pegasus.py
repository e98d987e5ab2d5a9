from transformers import PegasusConfig

TINY = {
    # embeddings x sqrt(d_model) and a relu MLP, so that embed_scale and the fc pairs are exercised
    "pegasus": lambda: PegasusConfig(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=128, scale_embedding=True,
                                     activation_function="relu", attn_implementation="eager",
                                     architectures=["PegasusForConditionalGeneration"]),
}
