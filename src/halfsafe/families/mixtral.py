"""Mixtral, and the mixture-of-experts layout Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 share (its templates:
builders.moe_family and the helpers beside it).

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

from .builders import moe_family

FAMILY = moe_family("mixtral", ("mixtral",), "intermediate_size")
