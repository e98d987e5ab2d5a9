"""Gemma 3 multimodal (a tiny SigLIP tower: 56 px, 14 px patches, 16 patches pooled to 4 image tokens) and
EmbeddingGemma (gemma3_text, bidirectional, headless Gemma3TextModel). The language models reuse gemma.py's.

Gemma 3 ties its head; the shared blown-up test unties it (make_tiny(untie=True)) and test_family_gemma3 runs a
random plan on the untied head too, so no separate untied key is needed."""

from transformers import Gemma3Config, Gemma3TextConfig

from .gemma import _COMMON

_TEXT = dict(_COMMON, query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
               patch_size=14, vision_use_head=False)


def _gemma3() -> Gemma3Config:
    # image_token_id outside the text vocabulary (as the model allows): random text ids never collide with it
    text = {k: v for k, v in _TEXT.items() if k != "attn_implementation"}
    config = Gemma3Config(text_config=text, vision_config=_VISION, mm_tokens_per_image=4, image_token_id=256,
                          boi_token_id=254, eoi_token_id=255, attn_implementation="eager",
                          architectures=["Gemma3ForConditionalGeneration"])
    return config


TINY = {
    "gemma3": _gemma3,
    "gemma3_text-embedding": lambda: Gemma3TextConfig(**_TEXT, use_bidirectional_attention=True, architectures=["Gemma3TextModel"]),
}
