"""gpt-oss: pre-norm, `x * w` RMSNorm (eps from `rms_norm_eps`), attention with biases and a learned
per-head sink logit, and a MoE block whose fused experts carry biases and a clamped SwiGLU.

Experts (`mlp.experts`, transposed: y = x @ W + b): gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]
([E, H, 2I], gate and up *interleaved*: columns ::2 and 1::2); gate clamped at `swiglu_limit` from above,
up to +-limit; out = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e], times
the routing weight. The router (linear with bias, top-k, softmax of the top-k logits) reads the normed
stream and does not move.

- residual: `embed_tokens`, `o_proj` (weight and bias), every expert's `down_proj` and `down_proj_bias`
  x a; tied head: `model.norm.weight` / a; `rms_norm_eps` x a^2.
- vo: `v_proj` (weight and bias) x c, `o_proj.weight` / c (its bias is added after and stays).
- qk: `q_proj` x c, `k_proj` / c (weights and biases). The sinks are concatenated to QK^T * scaling as
  an extra logit; QK^T does not change, so they stay.
- No expert up/down pair: the clamps (at a fixed limit) and the `up + 1` make the gated product neither
  homogeneous nor linear in up. The clamps also bound it: |down_proj input| <= limit * (limit + 1) (56 at
  limit 7), so gpt-oss's experts cannot overflow float16 there.
"""

from .builders import EXPERTS, MOE_BLOCK_WRITERS, MOE_WIDTHS, biased, decoder_attention_pairs
from .spec import EpsScope, Family, GroupSpec, Move, tied_head

L = "model.layers.{i}"

FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    groups=(
        GroupSpec("residual", (
            Move("model.embed_tokens.weight"),
            *biased(f"{L}.self_attn.o_proj"),
            Move(f"{EXPERTS}.down_proj"),
            Move(f"{EXPERTS}.down_proj_bias"),
            Move("model.norm.weight", -1, when=tied_head),
        ), eps_power=2, why="the residual stream and every write into it (every expert's down_proj and its bias)"),
        *decoder_attention_pairs(qk_norm=False),
    ),
    eps=(EpsScope(("rms_norm_eps",)),),
    residual_writers=(MOE_BLOCK_WRITERS,),
    unfixable="experts' gate_up pre-activations (clamped SwiGLU with up + 1: no scale passes through it; a gate "
              "pre-activation of -inf gives NaN); raw QK^T logits under eager attention",
    shrink_widths=MOE_WIDTHS,
)
