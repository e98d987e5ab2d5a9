from transformers import GPTNeoXConfig

# rotary_pct defaults to 0.25: partial RoPE
_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=128, bos_token_id=0, eos_token_id=0, attn_implementation="eager")

TINY = {
    "gpt_neox": lambda: GPTNeoXConfig(**_COMMON, use_parallel_residual=True),
    "gpt_neox-sequential": lambda: GPTNeoXConfig(**_COMMON, use_parallel_residual=False),
    "gpt_neox-tied": lambda: GPTNeoXConfig(**_COMMON, use_parallel_residual=True, tie_word_embeddings=True),
}
