from transformers import T5GemmaConfig, T5GemmaModuleConfig

_MODULE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, query_pre_attn_scalar=16,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def config(tied: bool) -> T5GemmaConfig:
    config = T5GemmaConfig(encoder=T5GemmaModuleConfig(**_MODULE), decoder=T5GemmaModuleConfig(**_MODULE),
                           vocab_size=256, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    return config


TINY = {
    # Every released T5Gemma ties lm_head to the decoder embedding; the blown-up test unties it anyway, and
    # tests/test_family_longt5_t5gemma.py checks an untied head's plan.
    "t5gemma": lambda: config(tied=True),
}
