"""Qwen3: Llama's block (pre-norm residual, `x * w` RMSNorm, gated SiLU MLP, RoPE) plus per-head RMSNorms
on q and k (`self_attn.q_norm`, `self_attn.k_norm`, gain over head_dim) that share `rms_norm_eps`.

- residual: `embed_tokens`, `o_proj`, `down_proj` (and their biases where `attention_bias`) x a; tied
  head: `model.norm.weight` / a; `rms_norm_eps` x a^2. The q/k norms read `q_proj`/`k_proj` outputs and
  share the moved eps, so `q_proj` and `k_proj` move by a as well: every norm's input then scales by a
  and Norm(a x; eps a^2) == Norm(x; eps) holds for all of them.
- vo: attention is linear in V; GQA repeats whole KV heads, and one c per block moves every V row.
- up_down: silu(gate) * up is linear in up.
- qk_norm: q_norm gain x c, k_norm gain / c. q_proj x c would be undone by q_norm, so the Q/K pair moves
  the gains instead; RoPE is linear and QK^T is unchanged.
"""

from .builders import llama_like

FAMILY = llama_like("qwen3", ("qwen3",), qk_norm=True)
