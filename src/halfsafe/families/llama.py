"""Llama and its close relatives: pre-norm residual, `x * w` RMSNorm, gated SiLU MLP, separate q/k/v/o.

Block: h = h + o(attn(q(n1 h), k(n1 h), v(n1 h))); h = h + down(silu(gate(n2 h)) * up(n2 h)).
Every write into the residual (embedding, o_proj, down_proj) scales with it; norms undo the scale on
their way out once the shared eps moves by s**2; a tied head reads the final norm, which absorbs 1/s.
Qwen3's per-head q/k norms share that eps, so q_proj and k_proj move with the residual as well; the
q/k pair then moves the q_norm/k_norm gains (x c, / c), which RoPE and QK^T see exactly as they would
see q x c, k / c.
"""

from .builders import llama_like

FAMILY = llama_like("llama", ("llama", "mistral", "qwen2"))
