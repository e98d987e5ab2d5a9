"""Qwen2-VL (`qwen2_vl`: Qwen2-VL-2B/7B/72B(-Instruct), QVQ-72B-Preview) and Qwen2.5-VL (`qwen2_5_vl`:
Qwen2.5-VL-3B/7B/32B/72B(-Instruct)): a Qwen2 language model (`model.language_model`: pre-norm, `x * w` RMSNorm,
biased q/k/v, M-RoPE) reading image tokens that a ViT (`model.visual`) writes into its input embeddings.

Language model: exactly Qwen2's groups (families/llama.py), one more writer into the residual stream:
  inputs_embeds[image tokens] = merger(visual(pixels));  merger(x) = mlp.2(gelu(mlp.0(ln_q(x))))
so `model.visual.merger.mlp.2` (weight and bias) moves with the residual, as the embedding does.
M-RoPE rotates q and k by position-dependent angles per frequency section: linear, so q x c, k / c holds.

Vision tower, pre-norm, its own residual stream (blocks.{i}):
  v = v + attn.proj(attn(qkv(norm1 v)));  v = v + mlp(norm2 v)
  Qwen2-VL: nn.LayerNorm (weight, bias), mlp = fc2(quick_gelu(fc1 .)).
  Qwen2.5-VL: RMSNorm `x * w`, mlp = down_proj(silu(gate_proj .) * up_proj .) (all biased), windowed attention
  in most blocks (a permutation of the patches, undone at the end).
  Attention: qkv rows are [q | k | v] (reshape(seq, 3, heads, -1)), biased; 2-D rotary on q and k; 1/sqrt(d).
- vis_vo: the V rows of qkv (weight and bias) x c, attn.proj columns / c (attention is linear in V).
- vis_qk: the Q rows x c, the K rows / c (weight and bias; rotary is linear, QK^T unchanged).
- vis_up_down (Qwen2.5-VL): up_proj (weight and bias) x c, down_proj columns / c.
- vision_residual: patch_embed.proj, attn.proj and the MLP output (fc2 / down_proj, weight and bias) x s; every
  block norm and the merger's ln_q read that stream, so it is exact only if their eps moves by s**2. That eps
  is hard-coded (1e-6 in modeling_qwen2_vl / modeling_qwen2_5_vl, no config field), so no checkpoint can carry
  it: a norm reading s x behaves as with eps / s**2, a relative change of about (1/s**2 - 1) eps / (2 var) in its
  output (var: its input's variance per token). Negligible where a plan lowers s (an input near float16's range
  has var >> 1e-6 / s**2); exact with that eps at 0 (tests/test_family_qwen2_vl.py measures both). The
  planner only moves it when calibration samples hold images (a dict sample with pixel_values).
The language model's eps moves by s**2 with its residual group; the tower's norms keep theirs
(`keep` in its EpsScope), even where the two values are equal (1e-6 in every release).
"""

from .builders import LLAMA_BLOCK_WRITERS, biased
from .spec import EpsScope, Family, GroupSpec, Move, StressHint, tied_head

L = "model.language_model.layers.{i}"
VIS = "model.visual"
B = f"{VIS}.blocks.{{i}}"
QKV = f"{B}.attn.qkv"


def _vision_dim(config) -> int:
    """The tower's width: Qwen2-VL's `embed_dim` (its `hidden_size` is the language model's); Qwen2.5-VL's `hidden_size`."""
    vision = config.vision_config
    return getattr(vision, "embed_dim", None) or vision.hidden_size


def _rows(part: int):
    return lambda config: slice(part * _vision_dim(config), (part + 1) * _vision_dim(config))


def _qkv(part: int, power: int = 1) -> tuple[Move, ...]:
    return (Move(f"{QKV}.weight", power, select=(0, _rows(part))), Move(f"{QKV}.bias", power, select=(0, _rows(part))))


def _family(name: str, model_type: str, mlp_out: str, gated: bool) -> Family:
    groups = [
        GroupSpec("residual", (
            Move("model.language_model.embed_tokens.weight"),
            *biased(f"{VIS}.merger.mlp.2"),
            *biased(f"{L}.self_attn.o_proj"),
            *biased(f"{L}.mlp.down_proj"),
            Move("model.language_model.norm.weight", -1, when=tied_head),
        ), eps_power=2, why="the language model's residual stream and every write into it, image embeddings included"),
        GroupSpec("vo", (*biased(f"{L}.self_attn.v_proj"), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows x c, o_proj columns / c"),
        GroupSpec("up_down", (*biased(f"{L}.mlp.up_proj"), Move(f"{L}.mlp.down_proj.weight", -1)), per_block=True,
                  why="the gated product is linear in up: up x c, down_proj / c"),
        GroupSpec("qk", (*biased(f"{L}.self_attn.q_proj"), *biased(f"{L}.self_attn.k_proj", -1)), per_block=True,
                  why="QK^T is unchanged by q x c, k / c (M-RoPE is linear)"),
        GroupSpec("vision_residual", (
            Move(f"{VIS}.patch_embed.proj.weight"),
            *biased(f"{B}.attn.proj"),
            *biased(f"{B}.mlp.{mlp_out}"),
        ), why="the vision tower's residual stream and every write into it (its norms' eps is fixed in code)"),
        GroupSpec("vis_vo", (*_qkv(2), Move(f"{B}.attn.proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows of qkv x c, proj columns / c"),
        GroupSpec("vis_qk", (*_qkv(0), *_qkv(1, -1)), per_block=True,
                  why="QK^T is unchanged by Q rows of qkv x c, K rows / c (rotary is linear)"),
    ]
    if gated:
        groups.append(GroupSpec("vis_up_down", (*biased(f"{B}.mlp.up_proj"), Move(f"{B}.mlp.down_proj.weight", -1)),
                                per_block=True, why="silu(gate) * up is linear in up: up x c, down_proj / c"))
    vision_mlp = "gate_proj pre-activations" if gated else "fc1 pre-activations (quick_gelu is not homogeneous)"
    return Family(
        name=name,
        model_types=(model_type,),
        groups=tuple(groups),
        eps=(EpsScope(("rms_norm_eps",), keep=(VIS,)),),
        residual_writers=(LLAMA_BLOCK_WRITERS, ("attn.proj", f"mlp.{mlp_out}")),  # language model, vision tower
        unfixable=(f"gate_proj pre-activations (SiLU is not homogeneous); the vision tower's {vision_mlp} and its "
                   "merger's mlp.0 pre-activations (GELU); raw QK^T logits under eager attention; the vision "
                   "residual moves only up to its norms' fixed eps (1e-6 / s**2)"),
        stress=StressHint(towers=(VIS,)),  # the stress blows up the language model's stream only
    )


QWEN2_VL = _family("qwen2_vl", "qwen2_vl", "fc2", gated=False)
QWEN2_5_VL = _family("qwen2_5_vl", "qwen2_5_vl", "down_proj", gated=True)
FAMILIES = (QWEN2_VL, QWEN2_5_VL)
