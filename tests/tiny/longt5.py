"""LongT5 as its checkpoints ship: gated-gelu (v1.1 recipe), tie_word_embeddings=False in config.json (transformers 5
turns that into "no d_model**-0.5 output scaling" and ties the head to `shared` anyway). A sequence of 24 tokens
spans several local blocks (radius 3) and global blocks (size 4). The shared tests run the transient-global
encoder (the one with more moves); tests/test_family_longt5_t5gemma.py checks the local one and ReLU."""

from transformers import LongT5Config

COMMON = dict(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, local_radius=3,
              global_block_size=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              decoder_start_token_id=0, attn_implementation="eager")

TINY = {
    "longt5-tglobal": lambda: LongT5Config(**COMMON, encoder_attention_type="transient-global"),
}
