"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorms sharing `rms_norm_eps`) and a sparse MoE block
without a shared expert; `mlp_only_layers` have a dense gated MLP.

- residual: as Mixtral, plus `q_proj`/`k_proj` (the q/k norms read them and share the moved eps).
- qk_norm: q_norm gain x c, k_norm gain / c; vo as Llama.
- expert_up_down (per expert, fused tensors), up_down (dense layers).
"""

from .builders import moe_family

FAMILY = moe_family("qwen3_moe", ("qwen3_moe",), "moe_intermediate_size", qk_norm=True)
