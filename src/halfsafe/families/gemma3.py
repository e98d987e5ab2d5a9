"""Gemma 3 multimodal (Gemma 3 4B/12B/27B, `Gemma3ForConditionalGeneration`; headless `Gemma3Model`): the
Gemma 3 language model under `model.language_model`, a SigLIP vision tower and a multi-modal projector.

Language model: as gemma3_text (families/gemma.py), under `model.language_model`. The projector writes each image
token's embedding into the residual stream in place of a text embedding: avg-pooled tower output ->
mm_soft_emb_norm (a Gemma (1+w) RMSNorm) -> @ mm_input_projection_weight. The text embedding is multiplied by
sqrt(hidden) inside the model, the image embedding is not, so mm_input_projection_weight simply moves with the
residual scale. Its eps is the text config's rms_norm_eps, and only the language model's norms copy it.

SigLIP tower: its own pre-norm residual stream (nn.LayerNorm with bias, eps = vision_config.layer_norm_eps).
Written by patch_embedding (weight and bias), position_embedding, every out_proj and fc2; its post_layernorm,
read only by the projector, moves too, so that mm_soft_emb_norm (which takes the tower's eps from the same
config field) reads an input scaled like its eps: the projector's output, hence the language model, is
unchanged. Pairs inside the tower: v/o and q/k (eager attention scales QK^T only by head_dim**-0.5).
With `vision_use_head` the tower also holds an attention-pooling head that reads post_layernorm and that Gemma 3
never runs: the tower groups then do not apply (no Gemma 3 checkpoint has one).
"""

from .builders import SANDWICH_BLOCK_WRITERS, SIGLIP_BLOCK_WRITERS, biased, gemma_pairs, gemma_sandwich
from .spec import EpsScope, Family, GroupSpec, Move, StressHint

LM = "model.language_model"
VT = "model.vision_tower"
PROJECTOR = "model.multi_modal_projector"
V = f"{VT}.encoder.layers.{{i}}"


def _headless_tower(model) -> bool:
    return not model.config.vision_config.vision_use_head


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    one_plus_norm_gains=True,
    groups=(
        GroupSpec("residual", (*gemma_sandwich(q_k_norms=True, lm=LM), Move(f"{PROJECTOR}.mm_input_projection_weight")),
                  eps_power=2, eps=EpsScope(("rms_norm_eps",), ("text_config",), (LM,)),
                  why="the language model's residual stream and every write into it, image tokens included"),
        *gemma_pairs(LM),
        GroupSpec("vision_residual", (
            *biased(f"{VT}.embeddings.patch_embedding"),
            Move(f"{VT}.embeddings.position_embedding.weight"),
            *biased(f"{V}.self_attn.out_proj"),
            *biased(f"{V}.mlp.fc2"),
            *biased(f"{VT}.post_layernorm"),
        ), eps_power=2, eps=EpsScope(("layer_norm_eps",), ("vision_config",), (VT, f"{PROJECTOR}.mm_soft_emb_norm")),
            when=_headless_tower, why="the SigLIP tower's residual stream, its writes and the post_layernorm the projector reads"),
        GroupSpec("vision_vo", (*biased(f"{V}.self_attn.v_proj"), Move(f"{V}.self_attn.out_proj.weight", -1)),
                  per_block=True, when=_headless_tower, why="attention is linear in V: V rows x c, out_proj columns / c"),
        GroupSpec("vision_qk", (*biased(f"{V}.self_attn.q_proj"), *biased(f"{V}.self_attn.k_proj", -1)),
                  per_block=True, when=_headless_tower, why="QK^T is unchanged by q x c, k / c"),
    ),
    unfixable="gate_proj pre-activations (GELU is not homogeneous); the SigLIP fc1 pre-activations (GELU); "
              "raw QK^T logits under eager attention; the tower is not rescaled when it has a pooling head (vision_use_head)",
    residual_writers=(SANDWICH_BLOCK_WRITERS, SIGLIP_BLOCK_WRITERS),
    notes="calibration runs one synthetic image (a gradient, forward.image_prompt) before the text, so the tower is "
          "scanned, probed and checked with the language model",
    stress=StressHint(towers=(VT,)),  # the stress blows up the language model's stream only
)
