from transformers import Qwen2MoeConfig

# Layer 0 dense (mlp_only_layers), layer 1 MoE with a shared expert.
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
               attn_implementation="eager")

# Tied heads (no released checkpoint has one): test_family_moe.py builds them from these configs.
TINY = {
    "qwen2_moe": lambda: Qwen2MoeConfig(**_COMMON, tie_word_embeddings=False),
}
