"""Qwen2-MoE: Qwen2's attention (q/k/v biases) and a sparse MoE block with a shared expert.

MoE block: y = experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x), x the normed stream; the
router (`mlp.gate`) and the shared-expert gate read x, so neither moves. Layers listed in
`mlp_only_layers` (or off the `decoder_sparse_step`) have a dense gated MLP instead.

- residual: `embed_tokens`, `o_proj`, every expert's `down_proj`, the shared expert's `down_proj`, a
  dense layer's `mlp.down_proj` x a; tied head: `model.norm.weight` / a; `rms_norm_eps` x a^2.
- vo, qk: as Qwen2 (q/k/v biases move with their rows).
- expert_up_down (per expert, fused tensors), shared_up_down, up_down (dense layers).
"""

from .builders import moe_family

FAMILY = moe_family("qwen2_moe", ("qwen2_moe",), "moe_intermediate_size", shared="shared_expert")
