from transformers import GPT2Config

_COMMON = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0,
               attn_implementation="eager")

TINY = {
    "gpt2": lambda: GPT2Config(**_COMMON, tie_word_embeddings=True),
    "gpt2-untied": lambda: GPT2Config(**_COMMON, tie_word_embeddings=False),
    # attention variants: a per-layer constant on the logits, and QK^T upcast to fp32
    "gpt2-upcast": lambda: GPT2Config(**_COMMON, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
}
