from transformers import GptOssConfig

# Two layers: one sliding-window, one full attention (the default layer_types alternate).
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=8, attn_implementation="eager")

# Tied heads (no released checkpoint has one): test_family_moe.py builds them from these configs, a random
# plan only (the blown-up test of test_families.py unties every head anyway).
TINY = {
    "gpt_oss": lambda: GptOssConfig(**_COMMON, tie_word_embeddings=False),
}
