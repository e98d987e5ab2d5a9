"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA), the first `first_k_dense_replace`
layers with a dense gated MLP, the rest MoE with fused routed experts plus `n_shared_experts` shared ones.

MLA (per block, x the normed stream; `r` = kv_lora_rank, heads of [nope | rope] query/key dims):
  q = q_b_proj(q_a_layernorm(q_a_proj x))          (or q_proj x without q_lora_rank)
  [c | k_rope] = kv_a_proj_with_mqa x               (rows [0, r) the latent, [r, r + rope) one shared rope key)
  [k_nope | v] per head = kv_b_proj(kv_a_layernorm c)
  out = o_proj(attn(q, [k_nope | rope(k_rope)], v)); RoPE (complex in V2, rotate-half or interleaved in V3)
  is linear. q_a_layernorm and kv_a_layernorm are built with the *default* eps 1e-6, not `rms_norm_eps`.
MoE: y = experts(x) (weights from a router on x, times `routed_scaling_factor`) + shared_experts(x).

- residual: `embed_tokens`, `o_proj`, dense `mlp.down_proj`, every expert's `down_proj`, the shared
  experts' `down_proj` (and biases where the config has them) x a; tied head: `model.norm.weight` / a;
  `rms_norm_eps` x a^2 (the block norms and the final norm read it). The MLA norms' eps is fixed in code,
  so a checkpoint cannot move it (`fixed` in its EpsScope); they read `q_a_proj` / `kv_a_proj_with_mqa`, which
  read the normed stream, and nothing in them moves.
- vo: kv_b_proj's v rows of every head x c, `o_proj.weight` / c.
- qk: q_b_proj (or q_proj) x c; kv_b_proj's k_nope rows / c and kv_a_proj_with_mqa's rope rows / c.
- up_down (dense layers), shared_up_down, expert_up_down (per routed expert).
The routers (softmax or sigmoid scores, V3's e_score_correction_bias, group-limited top-k,
`routed_scaling_factor`) read the normed stream and do not move.
"""

from __future__ import annotations

import torch

from .builders import LLAMA_BLOCK_WRITERS, MOE_BLOCK_WRITERS, MOE_WIDTHS, expert_up_down, mlp_up_down, moe_residual
from .spec import EpsScope, Family, GroupSpec, Move

A = "model.layers.{i}.self_attn"


def _rope_rows(config):
    return slice(config.kv_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim)


def _kv_b_rows(part: str):
    """kv_b_proj's output rows, per head [k_nope | v]: the k_nope or the v rows of every head."""
    def rows(config):
        nope, v = config.qk_nope_head_dim, config.v_head_dim
        off, size = (0, nope) if part == "k" else (nope, v)
        return torch.cat([torch.arange(h * (nope + v) + off, h * (nope + v) + off + size) for h in range(config.num_attention_heads)])
    return rows


FAMILY = Family(
    name="deepseek",
    model_types=("deepseek_v2", "deepseek_v3"),
    groups=(
        GroupSpec("residual", moe_residual(shared="shared_experts"), eps_power=2,
                  why="the residual stream and every write into it (dense, routed and shared experts' down_proj)"),
        GroupSpec("vo", (Move(f"{A}.kv_b_proj.weight", select=(0, _kv_b_rows("v"))), Move(f"{A}.o_proj.weight", -1)),
                  per_block=True, why="attention is linear in V: kv_b_proj's v rows x c, o_proj columns / c"),
        GroupSpec("qk", (
            Move(f"{A}.q_b_proj.weight", optional=True), Move(f"{A}.q_proj.weight", optional=True),
            Move(f"{A}.kv_b_proj.weight", -1, select=(0, _kv_b_rows("k"))),
            Move(f"{A}.kv_a_proj_with_mqa.weight", -1, select=(0, _rope_rows)),
            Move(f"{A}.kv_a_proj_with_mqa.bias", -1, select=(0, _rope_rows), optional=True),
        ), per_block=True, why="QK^T = q_nope k_nope + q_rope k_rope is unchanged by q x c, both key parts / c (RoPE is linear)"),
        mlp_up_down("mlp", "up_down"),
        mlp_up_down("mlp.shared_experts", "shared_up_down"),
        expert_up_down("moe_intermediate_size"),
    ),
    eps=(EpsScope(("rms_norm_eps",), fixed=("q_a_layernorm", "kv_a_layernorm"), fixed_value=1e-6),),
    residual_writers=(LLAMA_BLOCK_WRITERS, MOE_BLOCK_WRITERS),  # the first_k_dense_replace dense layers, then MoE
    unfixable="gate pre-activations of every expert (scanned per expert) and of dense and shared MLPs (SiLU is not "
              "homogeneous); raw QK^T logits under eager attention",
    # MLA's widths (per-head nope/rope/v dims, the latent ranks) and the routers' expert groups, in the shrunk copy
    shrink_widths={**MOE_WIDTHS, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
                   "q_lora_rank": 16, "n_group": 2, "topk_group": 1},
)
