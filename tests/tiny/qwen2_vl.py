"""Qwen2-VL and Qwen2.5-VL with a tiny vision tower: 4x4-pixel patches, 2 frames per temporal patch, a 2x2
spatial merge, so an image of grid (t, h, w) = (1, 4, 4) is 16 patches of 3*2*4*4 = 96 values and 4 image
tokens in the text. Token ids for image/video/vision start/end sit inside the 256-entry vocabulary.
`image_inputs(model)` builds that input: a synthetic deterministic image (a smooth gradient plus a seeded
pattern, already in the processor's normalised range) and a prompt holding its 4 image tokens."""

import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

IMAGE, VIDEO, START, END = 250, 251, 252, 253
GRID = (1, 4, 4)  # t, h, w in patches
_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,  # as released: same as the tower's
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
_VISION = dict(depth=2, num_heads=2, in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)


def _qwen2_vl(tied: bool) -> Qwen2VLConfig:
    config = Qwen2VLConfig(text_config=dict(_TEXT), vision_config=dict(_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2),
                           tie_word_embeddings=tied, **_TOKENS)
    config._attn_implementation = "eager"
    return config


def _qwen2_5_vl(tied: bool) -> Qwen2_5_VLConfig:
    config = Qwen2_5_VLConfig(text_config=dict(_TEXT),
                              vision_config=dict(_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                                 window_size=8, fullatt_block_indexes=[1]),
                              tie_word_embeddings=tied, **_TOKENS)
    config._attn_implementation = "eager"
    return config


def image_inputs(model, seed: int = 0) -> dict:
    """input_ids with one image's tokens, pixel_values (patches x 96) and image_grid_thw for the tiny towers."""
    vision = model.config.vision_config
    t, h, w = GRID
    per_patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    n_patches = t * h * w
    ramp = torch.linspace(-1.5, 1.5, n_patches * per_patch).reshape(n_patches, per_patch)
    g = torch.Generator().manual_seed(seed)
    pixels = ramp + 0.5 * torch.randn(n_patches, per_patch, generator=g)
    n_tokens = n_patches // vision.spatial_merge_size ** 2
    ids = torch.tensor([[1, 17, 33, START] + [IMAGE] * n_tokens + [END, 40, 41, 42, 43, 44, 45, 46]])
    mm_types = (ids == IMAGE).long()  # what the processor returns beside input_ids: 1 at image tokens (M-RoPE)
    return {"input_ids": ids, "mm_token_type_ids": mm_types, "pixel_values": pixels, "image_grid_thw": torch.tensor([GRID])}


TINY = {
    "qwen2_vl": lambda: _qwen2_vl(tied=True),  # Qwen2-VL-2B ties its head; 7B/72B do not (qwen2_5_vl covers untied)
    "qwen2_5_vl": lambda: _qwen2_5_vl(tied=False),  # Qwen2.5-VL-7B/32B/72B untied; 3B tied
}
