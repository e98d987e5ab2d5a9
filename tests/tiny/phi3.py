from transformers import Phi3Config

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")

TINY = {
    "phi3": lambda: Phi3Config(**_COMMON, tie_word_embeddings=False),
    "phi3-tied": lambda: Phi3Config(**_COMMON, tie_word_embeddings=True),
}
