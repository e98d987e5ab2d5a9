from transformers import BartConfig

TINY = {
    "bart": lambda: BartConfig(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                               max_position_embeddings=128, attn_implementation="eager",
                               architectures=["BartForConditionalGeneration"]),
}
