"""Phi-3: Llama's block with fused projections. `self_attn.qkv_proj` rows are [q | k | v]
(num_attention_heads*head_dim, then num_key_value_heads*head_dim twice); `mlp.gate_up_proj` rows are
[gate | up] (`gate, up = chunk(2)`; out = down(up * silu(gate))). No biases. RMSNorm is `x * w`.

- residual: `embed_tokens`, `o_proj`, `down_proj` x a; tied head: `model.norm.weight` / a;
  `rms_norm_eps` x a^2 (every RMSNorm reads the residual stream).
- vo: the V rows of `qkv_proj` x c, `o_proj` columns / c (attention is linear in V; GQA repeats heads).
- up_down: the up half of `gate_up_proj` (rows I:2I) x c, `down_proj` columns / c (the gated product
  is linear in up).
- qk: the Q rows of `qkv_proj` x c, the K rows / c (RoPE, partial or full, is linear; QK^T unchanged).
"""

from .builders import LLAMA_BLOCK_WRITERS, up_half
from .spec import EpsScope, Family, GroupSpec, Move, tied_head

L = "model.layers.{i}"
QKV = f"{L}.self_attn.qkv_proj.weight"
GATE_UP = f"{L}.mlp.gate_up_proj.weight"
UP_ROWS = up_half("intermediate_size")  # rows [I, 2I) of gate_up_proj


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _q_rows(config) -> slice:
    return slice(0, config.num_attention_heads * _head_dim(config))


def _k_rows(config) -> slice:
    q = config.num_attention_heads * _head_dim(config)
    return slice(q, q + config.num_key_value_heads * _head_dim(config))


def _v_rows(config) -> slice:
    q = config.num_attention_heads * _head_dim(config)
    kv = config.num_key_value_heads * _head_dim(config)
    return slice(q + kv, q + 2 * kv)


FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    groups=(
        GroupSpec("residual", (
            Move("model.embed_tokens.weight"),
            Move(f"{L}.self_attn.o_proj.weight"),
            Move(f"{L}.mlp.down_proj.weight"),
            Move("model.norm.weight", -1, when=tied_head),
        ), eps_power=2, why="the residual stream and every write into it"),
        GroupSpec("vo", (Move(QKV, select=(0, _v_rows)), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows of qkv_proj x c, o_proj columns / c"),
        GroupSpec("up_down", (Move(GATE_UP, select=(0, UP_ROWS)), Move(f"{L}.mlp.down_proj.weight", -1)), per_block=True,
                  why="up * silu(gate) is linear in up: the up half of gate_up_proj x c, down_proj / c"),
        GroupSpec("qk", (Move(QKV, select=(0, _q_rows)), Move(QKV, -1, select=(0, _k_rows))), per_block=True,
                  why="QK^T is unchanged by Q rows x c, K rows / c (RoPE is linear)"),
    ),
    eps=(EpsScope(("rms_norm_eps",)),),
    unfixable="the gate half of gate_up_proj (SiLU is not homogeneous); raw QK^T logits under eager attention",
    residual_writers=(LLAMA_BLOCK_WRITERS,),
)
