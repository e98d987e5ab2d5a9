from transformers import GPTNeoConfig

_COMMON = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
               attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=128,
               bos_token_id=0, eos_token_id=0, attn_implementation="eager")

TINY = {
    "gpt_neo": lambda: GPTNeoConfig(**_COMMON, tie_word_embeddings=True),
    "gpt_neo-untied": lambda: GPTNeoConfig(**_COMMON, tie_word_embeddings=False),
}
