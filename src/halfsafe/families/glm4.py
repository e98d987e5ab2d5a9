"""GLM-4 (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Llama's pre-norm block with sandwich norms, fused
`gate_up_proj` and partial rotary. RMSNorm is `x * w` (Glm4RMSNorm, eps `rms_norm_eps` in `variance_epsilon`).

Block (modeling_glm4.Glm4DecoderLayer):
  h = h + post_self_attn_layernorm(o(attn(q(n1 h), k(n1 h), v(n1 h))))        n1 = input_layernorm
  h = h + post_mlp_layernorm(down(up * silu(gate)))   [gate | up] = gate_up_proj(n2 h), n2 = post_attention_layernorm
(`post_attention_layernorm` is the norm *before* the MLP; the two post-branch norms are the residual writers.)

- residual: `embed_tokens` and the post-branch norm gains (the writes) x s; every norm reads an input that
  scales by s once `o_proj` and `down_proj` move with it too (the inputs of the post-branch norms), so the
  shared eps moves by s**2 and every norm puts out what it did. A tied head reads `model.norm`: gain / s.
  `o_proj` has no bias (q/k/v do, `attention_bias`).
- vo: v_proj (weight, bias) x c, o_proj columns / c (attention is linear in V; GQA repeats heads).
- qk: q_proj (weight, bias) x c, k_proj / c: partial RoPE rotates the first `partial_rotary_factor` of each head
  and passes the rest through, both linear, so QK^T is unchanged.
- up_down: rows I:2I of `gate_up_proj` (the up half, `gate, up = chunk(2)`) x c, down_proj / c.
No `x*(1+w)` gains, no soft-capping, no embedding multiplier: every move is a plain power-of-two multiplication.
"""

from .builders import biased, up_half
from .spec import EpsScope, Family, GroupSpec, Move, tied_head

L = "model.layers.{i}"
GATE_UP = f"{L}.mlp.gate_up_proj.weight"
UP_ROWS = up_half("intermediate_size")  # rows [I, 2I) of gate_up_proj

FAMILY = Family(
    name="glm4",
    model_types=("glm4",),
    groups=(
        GroupSpec("residual", (
            Move("model.embed_tokens.weight"),
            Move(f"{L}.post_self_attn_layernorm.weight"),
            Move(f"{L}.post_mlp_layernorm.weight"),
            *biased(f"{L}.self_attn.o_proj"),
            Move(f"{L}.mlp.down_proj.weight"),
            Move("model.norm.weight", -1, when=tied_head),
        ), eps_power=2, why="the residual stream and every write into it (post-branch norms, and their inputs)"),
        GroupSpec("vo", (*biased(f"{L}.self_attn.v_proj"), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V x c, o_proj columns / c"),
        GroupSpec("qk", (*biased(f"{L}.self_attn.q_proj"), *biased(f"{L}.self_attn.k_proj", -1)), per_block=True,
                  why="QK^T is unchanged by q x c, k / c (partial RoPE is linear)"),
        GroupSpec("up_down", (Move(GATE_UP, select=(0, UP_ROWS)), Move(f"{L}.mlp.down_proj.weight", -1)),
                  per_block=True, why="up * silu(gate) is linear in up: the up half of gate_up_proj x c, down_proj / c"),
    ),
    eps=(EpsScope(("rms_norm_eps",)),),
    unfixable="the gate half of gate_up_proj (SiLU is not homogeneous); raw QK^T logits under eager attention",
    residual_writers=(("post_self_attn_layernorm", "post_mlp_layernorm"),),
)
