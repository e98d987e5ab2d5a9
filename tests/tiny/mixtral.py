from transformers import MixtralConfig

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2,
               attn_implementation="eager")

# Tied heads (no released checkpoint has one): test_family_moe.py builds them from these configs, a random
# plan only (the blown-up test of test_families.py unties every head anyway).
TINY = {
    "mixtral": lambda: MixtralConfig(**_COMMON, tie_word_embeddings=False),
}
