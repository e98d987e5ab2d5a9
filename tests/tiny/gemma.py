from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, attn_implementation="eager")

TINY = {
    "gemma": lambda: GemmaConfig(**_COMMON),
    "gemma2": lambda: Gemma2Config(**_COMMON, query_pre_attn_scalar=16, sliding_window=8),
    "gemma3_text": lambda: Gemma3TextConfig(**_COMMON, query_pre_attn_scalar=16, sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention"]),
}
