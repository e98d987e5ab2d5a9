from transformers import Glm4Config

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, attn_implementation="eager",
               pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY = {
    "glm4": lambda: Glm4Config(**_COMMON, tie_word_embeddings=False),  # as GLM-4-9B/32B-0414 ship
    "glm4-tied": lambda: Glm4Config(**_COMMON, tie_word_embeddings=True),
}
