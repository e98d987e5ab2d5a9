"""Mixtral, and the mixture-of-experts templates Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 share.

Block (pre-norm, `x * w` RMSNorm, Llama attention): h = h + o(attn(n1 h)); x = n2 h;
h = h + sum_k w_k(x) down_k(silu(gate_k x) * up_k x), with the experts k and their weights w_k chosen by a
router that reads the normed x. transformers 5 stores every expert of a block in two fused tensors:
`mlp.experts.gate_up_proj` [E, 2I, H] (rows [0, I) gate, [I, 2I) up; `.chunk(2)`) and
`mlp.experts.down_proj` [E, H, I].

- residual: `embed_tokens`, `o_proj`, and every expert's `down_proj` (the whole fused tensor) x a; tied
  head: `model.norm.weight` / a; `rms_norm_eps` x a^2. The router reads n2 h, which the moved eps keeps
  bit-for-bit the same in exact arithmetic: the chosen experts and their weights do not change.
- vo, qk: as Llama.
- expert_up_down, one group per expert of each block: its up rows of `gate_up_proj` x c, its slice of
  `down_proj` / c (silu(gate) * up is linear in up; the routing weight multiplies the expert's output).
  The experts run inside one module; the scan (stats.expert_products) recomputes each expert's gate, up
  and gated product ("mlp.experts:expert<e>"), so the plan sees and moves each expert on its own.
"""

from __future__ import annotations

from typing import Callable

from .llama import L, _biased
from .spec import Family, GroupSpec, Move, has_param, tied_head

EXPERTS = f"{L}.mlp.experts"


def up_rows(intermediate: str) -> Callable:
    """The up half of a concatenated [gate; up] fused expert tensor (dim 1)."""
    return lambda config: slice(getattr(config, intermediate), 2 * getattr(config, intermediate))


def expert_up_down(intermediate: str) -> GroupSpec:
    """Each expert's own up/down pair in fused [E, 2I, H] / [E, H, I] tensors."""
    return GroupSpec("expert_up_down", (
        Move(f"{EXPERTS}.gate_up_proj", 1, select=(1, up_rows(intermediate)), expert=0),
        Move(f"{EXPERTS}.down_proj", -1, expert=0),
    ), per_block=True, per_expert=True, when=has_param(f"{EXPERTS}.gate_up_proj"),
        why="silu(gate) * up is linear in each expert's up: its up rows x c, its down_proj / c")


def mlp_up_down(mlp: str, name: str) -> GroupSpec:
    """A gated MLP's up/down pair (a dense layer's MLP, a shared expert); only where the model has one."""
    return GroupSpec(name, (*_biased(f"{L}.{mlp}.up_proj"), Move(f"{L}.{mlp}.down_proj.weight", -1)), per_block=True,
                     when=has_param(f"{L}.{mlp}.up_proj.weight"),
                     why="the gated product is linear in up: up x c, down_proj / c")


def attention_pairs(qk_norm: bool) -> tuple[GroupSpec, ...]:
    vo = GroupSpec("vo", (*_biased(f"{L}.self_attn.v_proj"), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
                   why="attention is linear in V: V rows x c, o_proj columns / c")
    if qk_norm:
        return vo, GroupSpec("qk_norm", (Move(f"{L}.self_attn.q_norm.weight"), Move(f"{L}.self_attn.k_norm.weight", -1)),
                             per_block=True, why="QK^T is unchanged by q_norm gain x c, k_norm gain / c (RoPE is linear)")
    return vo, GroupSpec("qk", (*_biased(f"{L}.self_attn.q_proj"), *_biased(f"{L}.self_attn.k_proj", -1)), per_block=True,
                         why="QK^T is unchanged by q x c, k / c (RoPE is linear)")


def moe_residual(shared: str | None = None, qk_norm: bool = False) -> tuple[Move, ...]:
    """embed, o_proj, every down projection that writes into the residual (dense MLP, all experts, the
    shared expert): optional each, since a block has a dense MLP or experts (the probe then proves that
    every block's writes moved: a block left out changes the output)."""
    moves = (
        Move("model.embed_tokens.weight"),
        *_biased(f"{L}.self_attn.o_proj"),
        Move(f"{L}.mlp.down_proj.weight", optional=True), Move(f"{L}.mlp.down_proj.bias", optional=True),
        Move(f"{EXPERTS}.down_proj", optional=True),
        Move("model.norm.weight", -1, when=tied_head),
    )
    if shared:
        moves += (Move(f"{L}.mlp.{shared}.down_proj.weight", optional=True), Move(f"{L}.mlp.{shared}.down_proj.bias", optional=True))
    if qk_norm:  # q/k norms read q_proj/k_proj outputs and share the eps: their inputs must scale too
        moves += (*_biased(f"{L}.self_attn.q_proj"), *_biased(f"{L}.self_attn.k_proj"))
    return moves


def moe_family(name: str, model_types: tuple[str, ...], intermediate: str, shared: str | None = None,
               qk_norm: bool = False, unfixable: str = "") -> Family:
    groups = [
        GroupSpec("residual", moe_residual(shared, qk_norm), eps_power=2,
                  why="the residual stream and every write into it (every expert's down_proj)"),
        *attention_pairs(qk_norm),
        mlp_up_down("mlp", "up_down"),
        expert_up_down(intermediate),
    ]
    if shared:
        groups.append(mlp_up_down(f"mlp.{shared}", "shared_up_down"))
    return Family(
        name=name,
        model_types=model_types,
        groups=tuple(groups),
        eps_attrs=("rms_norm_eps",),
        unfixable=unfixable or ("gate pre-activations of every expert (scanned per expert) and of dense and shared MLPs "
                                "(SiLU is not homogeneous); raw QK^T logits under eager attention"),
    )


FAMILY = moe_family("mixtral", ("mixtral",), "intermediate_size")
