"""Gemma, Gemma 2, Gemma 3 (text): RMSNorm computes x * (1 + w) in fp32; embeddings are multiplied by
sqrt(hidden) inside the model (recomputed from the config, so no checkpoint can change it).

Gemma 1 is pre-norm like Llama. Gemma 2/3 wrap each branch in sandwich norms: the residual is written
only by the embedding and the post-norms, whose gains become s(1+w)-1. o_proj/down_proj (and Gemma 3's
q/k projections, read by q/k norms) still move with s so that every norm input scales by s and the
shared eps can move by s**2: the function stays exact, not just close. A tied head reads the final
norm: (1+w)/s - 1. Trap: s(1+w)-1 stored in fp16 rounds, more as s shrinks; the planner measures it.
"""

from .builders import LLAMA_BLOCK_WRITERS, SANDWICH_BLOCK_WRITERS, biased, gemma_pairs, gemma_sandwich, gemma_tied_head
from .spec import EpsScope, Family, GroupSpec, Move

_UNFIXABLE = "gate_proj pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention"


def _family(name, model_types, residual_moves, writers, notes=""):
    return Family(
        name=name,
        model_types=model_types,
        groups=(GroupSpec("residual", residual_moves, eps_power=2, why="the residual stream and every write into it"),
                *gemma_pairs()),
        eps=(EpsScope(("rms_norm_eps",)),),
        unfixable=_UNFIXABLE,
        notes=notes,
        residual_writers=(writers,),
        one_plus_norm_gains=True,
    )


GEMMA = _family("gemma", ("gemma",), (
    Move("model.embed_tokens.weight"), *biased("model.layers.{i}.self_attn.o_proj"), *biased("model.layers.{i}.mlp.down_proj"),
    gemma_tied_head()), LLAMA_BLOCK_WRITERS)
GEMMA2 = _family("gemma2", ("gemma2",), gemma_sandwich(q_k_norms=False), SANDWICH_BLOCK_WRITERS,
                 notes="eager attention with logit softcapping; query_pre_attn_scalar stays as it is")
GEMMA3 = _family("gemma3_text", ("gemma3_text",), gemma_sandwich(q_k_norms=True), SANDWICH_BLOCK_WRITERS,
                 notes="EmbeddingGemma is gemma3_text with bidirectional attention, used headless (Gemma3TextModel): "
                       "no head, so the final norm keeps its gain and the last hidden state is unchanged")
FAMILIES = (GEMMA, GEMMA2, GEMMA3)
