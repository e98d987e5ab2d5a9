from transformers import Qwen3Config

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, attn_implementation="eager")

TINY = {
    "qwen3": lambda: Qwen3Config(**_COMMON, tie_word_embeddings=False),
    "qwen3-tied": lambda: Qwen3Config(**_COMMON, tie_word_embeddings=True),
}
