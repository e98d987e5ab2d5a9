"""T5Gemma 2 with a tiny SigLIP tower: 16x16-pixel images of 4x4 patches (16 patches), pooled to 4 image tokens.
Token ids: image 250, begin/end of image 251/252 (the end-of-image token has its own embedding, `eoi_embedding`).
`image_inputs(model)` builds one synthetic deterministic image and a prompt holding its 4 image tokens."""

import torch
from transformers import SiglipVisionConfig
from transformers.models.t5gemma2.configuration_t5gemma2 import (
    T5Gemma2Config,
    T5Gemma2DecoderConfig,
    T5Gemma2EncoderConfig,
    T5Gemma2TextConfig,
)

IMAGE, BOI, EOI = 250, 251, 252
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, query_pre_attn_scalar=16,
             sliding_window=8, layer_types=["sliding_attention", "full_attention"])
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
               patch_size=4, vision_use_head=False)


def config(tied: bool = True) -> T5Gemma2Config:
    encoder = T5Gemma2EncoderConfig(text_config=T5Gemma2TextConfig(**_TEXT), vision_config=SiglipVisionConfig(**_VISION),
                                    mm_tokens_per_image=4, boi_token_index=BOI, eoi_token_index=EOI,
                                    image_token_index=IMAGE)
    config = T5Gemma2Config(encoder=encoder, decoder=T5Gemma2DecoderConfig(**_TEXT), image_token_index=IMAGE,
                            eoi_token_index=EOI, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    return config


def image_inputs(model, seed: int = 0) -> dict:
    """input_ids with one image's 4 tokens between begin/end-of-image, and pixel_values (1, 3, 16, 16)."""
    ramp = torch.linspace(-1, 1, 16)
    g = torch.Generator().manual_seed(seed)
    pixels = (ramp[None, :, None] * ramp[None, None, :]).expand(3, 16, 16) + 0.3 * torch.randn(3, 16, 16, generator=g)
    ids = torch.tensor([[2, 17, 33, BOI] + [IMAGE] * 4 + [EOI, 40, 41, 42, 43, 44, 45, 46]])
    return {"input_ids": ids, "pixel_values": pixels[None]}


TINY = {
    "t5gemma2": lambda: config(tied=True),  # released T5Gemma 2 checkpoints tie the head and both embeddings
}
