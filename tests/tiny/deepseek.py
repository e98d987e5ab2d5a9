from transformers import DeepseekV2Config, DeepseekV3Config

# Layer 0 dense (first_k_dense_replace=1), layer 1 MoE: 4 routed experts (top-2) and a shared expert.
_MLA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            max_position_embeddings=128, attn_implementation="eager")

# Tied heads (no released checkpoint has one): test_family_moe.py builds them from these configs.
TINY = {
    # V2-Lite style: no q LoRA (q_proj), softmax routing, routed_scaling_factor 16 (DeepSeek-V2's).
    "deepseek_v2": lambda: DeepseekV2Config(**_MLA, q_lora_rank=None, routed_scaling_factor=16.0, tie_word_embeddings=False),
    # V3: q LoRA, sigmoid group-limited routing with the score-correction bias, interleaved RoPE.
    "deepseek_v3": lambda: DeepseekV3Config(**_MLA, q_lora_rank=24, n_group=2, topk_group=1, tie_word_embeddings=False),
}
