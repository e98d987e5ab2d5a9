"""Gemma, Gemma 2, Gemma 3 (text): RMSNorm computes x * (1 + w) in fp32; embeddings are multiplied by
sqrt(hidden) inside the model (recomputed from the config, so no checkpoint can change it).

Gemma 1 is pre-norm like Llama. Gemma 2/3 wrap each branch in sandwich norms: the residual is written
only by the embedding and the post-norms, whose gains become s(1+w)-1. o_proj/down_proj (and Gemma 3's
q/k projections, read by q/k norms) still move with s so that every norm input scales by s and the
shared eps can move by s**2: the function stays exact, not just close. A tied head reads the final
norm: (1+w)/s - 1. Trap: s(1+w)-1 stored in fp16 rounds, more as s shrinks; the planner measures it.
"""

from .llama import L, _biased
from .spec import GAIN1P, Family, GroupSpec, Move, tied_head

_PAIRS = (
    GroupSpec("vo", (*_biased(f"{L}.self_attn.v_proj"), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
              why="attention is linear in V: V rows x c, o_proj columns / c"),
    GroupSpec("up_down", (*_biased(f"{L}.mlp.up_proj"), Move(f"{L}.mlp.down_proj.weight", -1)), per_block=True,
              why="the gated product is linear in up: up x c, down_proj / c"),
)
_HEAD = Move("model.norm.weight", -1, GAIN1P, when=tied_head)
_UNFIXABLE = "gate_proj pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention"


def _sandwich(q_k_norms: bool) -> tuple[Move, ...]:
    moves = (
        Move("model.embed_tokens.weight"),
        Move(f"{L}.post_attention_layernorm.weight", 1, GAIN1P),
        Move(f"{L}.post_feedforward_layernorm.weight", 1, GAIN1P),
        *_biased(f"{L}.self_attn.o_proj"),
        *_biased(f"{L}.mlp.down_proj"),
        _HEAD,
    )
    if q_k_norms:
        moves += (*_biased(f"{L}.self_attn.q_proj"), *_biased(f"{L}.self_attn.k_proj"))
    return moves


def _family(name, model_types, residual_moves, notes=""):
    return Family(
        name=name,
        model_types=model_types,
        groups=(GroupSpec("residual", residual_moves, eps_power=2, why="the residual stream and every write into it"), *_PAIRS),
        eps_attrs=("rms_norm_eps",),
        unfixable=_UNFIXABLE,
        notes=notes,
    )


GEMMA = _family("gemma", ("gemma",), (
    Move("model.embed_tokens.weight"), *_biased(f"{L}.self_attn.o_proj"), *_biased(f"{L}.mlp.down_proj"), _HEAD))
GEMMA2 = _family("gemma2", ("gemma2",), _sandwich(q_k_norms=False),
                 notes="eager attention with logit softcapping; query_pre_attn_scalar stays as it is")
GEMMA3 = _family("gemma3_text", ("gemma3_text",), _sandwich(q_k_norms=True))
FAMILIES = (GEMMA, GEMMA2, GEMMA3)
