"""Gemma 4: text-only (dense with per-layer inputs and shared KV, MoE, untied head) and multimodal
(tiny vision and audio towers)."""

from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=128, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=256,
             hidden_size_per_layer_input=8, final_logit_softcapping=30.0, pad_token_id=0, attn_implementation="eager")


def _text(**over):
    return Gemma4TextConfig(**{**_TEXT, **over})


def _multimodal():
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                                position_embedding_size=16, attn_implementation="eager")
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                              attention_chunk_size=4, attention_context_left=5, output_proj_dims=48, use_clipped_linears=False)
    return Gemma4Config(text_config=_text(num_kv_shared_layers=0, hidden_size_per_layer_input=8).to_dict(),
                        vision_config=vision.to_dict(), audio_config=audio.to_dict(), image_token_id=250,
                        audio_token_id=251, video_token_id=252, boi_token_id=253, eoi_token_id=254, boa_token_id=255,
                        eoa_token_index=249, attn_implementation="eager")


TINY = {
    # per-layer inputs, the last block reusing the K/V of the full-attention block before it, tied head
    "gemma4_text": lambda: _text(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                                 num_kv_shared_layers=1),
    # MoE blocks, full-attention keys as values (attention_k_eq_v), untied head; block 0 keeps its keys to
    # itself (the last block of each attention type stores them for assistant models): its Q/K pair moves
    "gemma4_text-moe": lambda: _text(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                     enable_moe_block=True, tie_word_embeddings=False, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                     hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1),
    "gemma4": _multimodal,
}
