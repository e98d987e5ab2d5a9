from transformers import LlamaConfig, MistralConfig, Qwen2Config

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")

TINY = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama-tied": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=16),
    "qwen2": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=True),
}
