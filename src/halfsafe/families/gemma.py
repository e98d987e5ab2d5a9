"""Gemma, Gemma 2, Gemma 3 (text): RMSNorm computes x * (1 + w) in fp32; embeddings are multiplied by
sqrt(hidden) inside the model (recomputed from the config, so no checkpoint can change it).

Gemma 1 is pre-norm like Llama. Gemma 2/3 wrap each branch in sandwich norms: the residual is written
only by the embedding and the post-norms, whose gains become s(1+w)-1. o_proj/down_proj (and Gemma 3's
q/k projections, read by q/k norms) still move with s so that every norm input scales by s and the
shared eps can move by s**2: the function stays exact, not just close. A tied head reads the final
norm: (1+w)/s - 1. Trap: s(1+w)-1 stored in fp16 rounds, more as s shrinks; the planner measures it.
"""

from .llama import _biased
from .spec import GAIN1P, Family, GroupSpec, Move, tied_head

_UNFIXABLE = "gate_proj pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention"


def pairs(lm: str = "model") -> tuple[GroupSpec, ...]:
    """The v/o and up/down pairs of the language model under `lm` (Gemma 3 multimodal: model.language_model)."""
    L = f"{lm}.layers.{{i}}"
    return (
        GroupSpec("vo", (*_biased(f"{L}.self_attn.v_proj"), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows x c, o_proj columns / c"),
        GroupSpec("up_down", (*_biased(f"{L}.mlp.up_proj"), Move(f"{L}.mlp.down_proj.weight", -1)), per_block=True,
                  why="the gated product is linear in up: up x c, down_proj / c"),
    )


_PAIRS = pairs()


def _head(lm: str = "model") -> Move:
    return Move(f"{lm}.norm.weight", -1, GAIN1P, when=tied_head)


def sandwich(q_k_norms: bool, lm: str = "model") -> tuple[Move, ...]:
    """The residual moves of a Gemma 2/3 language model under `lm`."""
    L = f"{lm}.layers.{{i}}"
    moves = (
        Move(f"{lm}.embed_tokens.weight"),
        Move(f"{L}.post_attention_layernorm.weight", 1, GAIN1P),
        Move(f"{L}.post_feedforward_layernorm.weight", 1, GAIN1P),
        *_biased(f"{L}.self_attn.o_proj"),
        *_biased(f"{L}.mlp.down_proj"),
        _head(lm),
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
    Move("model.embed_tokens.weight"), *_biased("model.layers.{i}.self_attn.o_proj"), *_biased("model.layers.{i}.mlp.down_proj"),
    _head()))
GEMMA2 = _family("gemma2", ("gemma2",), sandwich(q_k_norms=False),
                 notes="eager attention with logit softcapping; query_pre_attn_scalar stays as it is")
GEMMA3 = _family("gemma3_text", ("gemma3_text",), sandwich(q_k_norms=True),
                 notes="EmbeddingGemma is gemma3_text with bidirectional attention, used headless (Gemma3TextModel): "
                       "no head, so the final norm keeps its gain and the last hidden state is unchanged")
FAMILIES = (GEMMA, GEMMA2, GEMMA3)
