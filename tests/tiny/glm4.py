from transformers import Glm4Config

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, attn_implementation="eager",
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def config(tied: bool = False) -> Glm4Config:
    return Glm4Config(**_COMMON, tie_word_embeddings=tied)


# GLM-4-9B/32B-0414 ship untied heads; the blown-up test unties every head anyway, so the tied head's plan is
# checked in tests/test_family_glm4.py instead of repeating that test.
TINY = {"glm4": config}
