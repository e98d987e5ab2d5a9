"""Llama and its close relatives: pre-norm residual, `x * w` RMSNorm, gated SiLU MLP, separate q/k/v/o.

Block: h = h + o(attn(q(n1 h), k(n1 h), v(n1 h))); h = h + down(silu(gate(n2 h)) * up(n2 h)).
Every write into the residual (embedding, o_proj, down_proj) scales with it; norms undo the scale on
their way out once the shared eps moves by s**2; a tied head reads the final norm, which absorbs 1/s.
Qwen3's per-head q/k norms share that eps, so q_proj and k_proj move with the residual as well; the
q/k pair then moves the q_norm/k_norm gains (x c, / c), which RoPE and QK^T see exactly as they would
see q x c, k / c.
"""

from .spec import Family, GroupSpec, Move, tied_head

L = "model.layers.{i}"


def _biased(param: str, power: int = 1) -> tuple[Move, ...]:
    """A linear layer's weight and (where the config has one) its bias, moving together."""
    return (Move(f"{param}.weight", power), Move(f"{param}.bias", power, optional=True))


def llama_like(name: str, model_types: tuple[str, ...], qk_norm: bool = False, notes: str = "") -> Family:
    residual = (
        Move("model.embed_tokens.weight"),
        *_biased(f"{L}.self_attn.o_proj"),
        *_biased(f"{L}.mlp.down_proj"),
        Move("model.norm.weight", -1, when=tied_head),
    )
    if qk_norm:  # q/k norms read q_proj/k_proj outputs and share the eps: their inputs must scale too
        residual += (*_biased(f"{L}.self_attn.q_proj"), *_biased(f"{L}.self_attn.k_proj"))
    groups = [
        GroupSpec("residual", residual, eps_power=2, why="the residual stream and every write into it"),
        GroupSpec("vo", (*_biased(f"{L}.self_attn.v_proj"), Move(f"{L}.self_attn.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows x c, o_proj columns / c"),
        GroupSpec("up_down", (*_biased(f"{L}.mlp.up_proj"), Move(f"{L}.mlp.down_proj.weight", -1)), per_block=True,
                  why="the gated product is linear in up: up x c, down_proj / c"),
    ]
    if not qk_norm:
        groups.append(GroupSpec("qk", (*_biased(f"{L}.self_attn.q_proj"), *_biased(f"{L}.self_attn.k_proj", -1)),
                                per_block=True, why="QK^T is unchanged by q x c, k / c (RoPE is linear)"))
    else:  # the q/k norm gains sit after the normalisation, before RoPE: the pair moves there instead
        groups.append(GroupSpec("qk_norm", (Move(f"{L}.self_attn.q_norm.weight"), Move(f"{L}.self_attn.k_norm.weight", -1)),
                                per_block=True, why="QK^T is unchanged by q_norm gain x c, k_norm gain / c (RoPE is linear)"))
    return Family(
        name=name,
        model_types=model_types,
        groups=tuple(groups),
        eps_attrs=("rms_norm_eps",),
        unfixable="gate_proj pre-activations (SiLU is not homogeneous); raw QK^T logits under eager attention",
        notes=notes,
    )


FAMILY = llama_like("llama", ("llama", "mistral", "qwen2"))
