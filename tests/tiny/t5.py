"""Transformers 5's T5 configs force `tie_word_embeddings=True`, so every model built from one has its head
tied to `shared`; `tie_word_embeddings=False` only turns off v1.0's d_model**-0.5 output scaling. A v1.1
checkpoint's separate `lm_head` is untied at load time (tests/test_t5.py builds that layout)."""

from transformers import MT5Config, T5Config, UMT5Config

_COMMON = dict(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, attn_implementation="eager",
               decoder_start_token_id=0)  # real T5 config.json files set it; T5Config has no default
_GATED = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)  # as v1.1/Flan/mT5/UMT5 config.json files say

TINY = {
    "t5": lambda: T5Config(**_COMMON),  # v1.0: relu, output x d_model**-0.5
    "t5-v1_1": lambda: T5Config(**_COMMON, **_GATED),
    "mt5": lambda: MT5Config(**_COMMON, **_GATED),
    "umt5": lambda: UMT5Config(**_COMMON, **_GATED),
}
