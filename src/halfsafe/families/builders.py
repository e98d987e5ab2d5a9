"""Move helpers and group templates that several family modules share.

Family modules import from here and from spec only, never from each other: a family's data then reads on its
own, and the registry (families/registry.py) can import every module it finds without caring about order.
The math behind each template is written up in the docstring of the family module that introduced it
(families/llama.py, mixtral.py, t5.py, bart.py, gemma.py, t5gemma.py).
"""

from __future__ import annotations

from typing import Callable

from .spec import GAIN1P, EpsScope, Family, GroupSpec, Move, has_param, tied_head

# -- single moves ---------------------------------------------------------------------------------------------


def biased(param: str, power: int = 1) -> tuple[Move, ...]:
    """A linear layer's weight and (where the config has one) its bias, moving together."""
    return (Move(f"{param}.weight", power), Move(f"{param}.bias", power, optional=True))


def linear(path: str, power: int = 1) -> tuple[Move, ...]:
    """A linear layer that always has a bias: weight and bias together."""
    return (Move(f"{path}.weight", power), Move(f"{path}.bias", power))


def norm(path: str, power: int = 1, when=None) -> tuple[Move, ...]:
    """A LayerNorm's output: its weight and bias together."""
    return (Move(f"{path}.weight", power, when=when), Move(f"{path}.bias", power, when=when))


def gain(module: str, power: int = 1, when=None) -> Move:
    """A Gemma-style `x * (1 + w)` norm gain: 1 + w moves by the scale."""
    return Move(f"{module}.weight", power, GAIN1P, when=when)


def class_in(names) -> Callable:
    """fn(model) -> bool: the model's class is one of `names` (for moves only some head classes have)."""
    names = frozenset(names)
    return lambda model: type(model).__name__ in names


def up_half(intermediate: str) -> Callable:
    """fn(config) -> the up rows [I, 2I) of a fused [gate; up] tensor (`gate, up = chunk(2)`), I read from the
    text config's `intermediate` field."""
    def rows(config) -> slice:
        size = getattr(config.get_text_config(), intermediate)
        return slice(size, 2 * size)
    return rows


# -- residual writers shared by several families (Family.residual_writers) -----------------------------------
LLAMA_BLOCK_WRITERS = ("self_attn.o_proj", "mlp.down_proj")  # a pre-norm decoder block with a dense MLP
MOE_BLOCK_WRITERS = ("self_attn.o_proj", "mlp")  # the whole mixture-of-experts block writes, not one projection
SANDWICH_BLOCK_WRITERS = ("post_attention_layernorm", "post_feedforward_layernorm")  # Gemma 2/3/4 post-branch norms
SIGLIP_BLOCK_WRITERS = ("self_attn.out_proj", "mlp.fc2")  # a SigLIP vision encoder layer
T5_DECODER_WRITERS = ("layer.0.SelfAttention.o", "layer.1.EncDecAttention.o", "layer.2.DenseReluDense.wo")
BART_DECODER_WRITERS = ("self_attn.out_proj", "encoder_attn.out_proj", "fc2")
BART_ENCODER_WRITERS = ("self_attn.out_proj", "fc2")
T5GEMMA_SELF_WRITERS = ("post_self_attn_layernorm", "post_feedforward_layernorm")  # a block without cross-attention

# -- widths of the shrunk copy the probe runs on (Family.shrink_widths) that mixture-of-experts configs name ----
# The expert counts (one name or another), how many experts each token takes (kept <= the count), their MLP widths.
MOE_WIDTHS = {"num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4,
              "num_experts_per_tok": 2, "top_k_experts": 2, "experts_per_token": 2,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}


# -- Llama-style decoders (families/llama.py, qwen3.py) -------------------------------------------------------
_L = "model.layers.{i}"


def llama_like(name: str, model_types: tuple[str, ...], qk_norm: bool = False, notes: str = "") -> Family:
    residual = (
        Move("model.embed_tokens.weight"),
        *biased(f"{_L}.self_attn.o_proj"),
        *biased(f"{_L}.mlp.down_proj"),
        Move("model.norm.weight", -1, when=tied_head),
    )
    if qk_norm:  # q/k norms read q_proj/k_proj outputs and share the eps: their inputs must scale too
        residual += (*biased(f"{_L}.self_attn.q_proj"), *biased(f"{_L}.self_attn.k_proj"))
    vo, qk = decoder_attention_pairs(qk_norm)
    up_down = GroupSpec("up_down", (*biased(f"{_L}.mlp.up_proj"), Move(f"{_L}.mlp.down_proj.weight", -1)), per_block=True,
                        why="the gated product is linear in up: up x c, down_proj / c")
    return Family(
        name=name,
        model_types=model_types,
        groups=(GroupSpec("residual", residual, eps_power=2, why="the residual stream and every write into it"), vo, up_down, qk),
        eps=(EpsScope(("rms_norm_eps",)),),
        unfixable="gate_proj pre-activations (SiLU is not homogeneous); raw QK^T logits under eager attention",
        notes=notes,
        residual_writers=(LLAMA_BLOCK_WRITERS,),
    )


def decoder_attention_pairs(qk_norm: bool) -> tuple[GroupSpec, GroupSpec]:
    """(vo, qk) of a Llama-style attention; with per-head q/k norms the Q/K pair moves their gains instead."""
    vo = GroupSpec("vo", (*biased(f"{_L}.self_attn.v_proj"), Move(f"{_L}.self_attn.o_proj.weight", -1)), per_block=True,
                   why="attention is linear in V: V rows x c, o_proj columns / c")
    if qk_norm:  # the q/k norm gains sit after the normalisation, before RoPE: the pair moves there instead
        return vo, GroupSpec("qk_norm", (Move(f"{_L}.self_attn.q_norm.weight"), Move(f"{_L}.self_attn.k_norm.weight", -1)),
                             per_block=True, why="QK^T is unchanged by q_norm gain x c, k_norm gain / c (RoPE is linear)")
    return vo, GroupSpec("qk", (*biased(f"{_L}.self_attn.q_proj"), *biased(f"{_L}.self_attn.k_proj", -1)), per_block=True,
                         why="QK^T is unchanged by q x c, k / c (RoPE is linear)")


# -- mixtures of experts (families/mixtral.py, qwen2_moe.py, qwen3_moe.py, deepseek.py, gpt_oss.py) -----------
EXPERTS = f"{_L}.mlp.experts"


def expert_up_down(intermediate: str) -> GroupSpec:
    """Each expert's own up/down pair in fused [E, 2I, H] / [E, H, I] tensors."""
    return GroupSpec("expert_up_down", (
        Move(f"{EXPERTS}.gate_up_proj", 1, select=(1, up_half(intermediate)), expert=0),
        Move(f"{EXPERTS}.down_proj", -1, expert=0),
    ), per_block=True, per_expert=True, when=has_param(f"{EXPERTS}.gate_up_proj"),
        why="silu(gate) * up is linear in each expert's up: its up rows x c, its down_proj / c")


def mlp_up_down(mlp: str, name: str) -> GroupSpec:
    """A gated MLP's up/down pair (a dense layer's MLP, a shared expert); only where the model has one."""
    return GroupSpec(name, (*biased(f"{_L}.{mlp}.up_proj"), Move(f"{_L}.{mlp}.down_proj.weight", -1)), per_block=True,
                     when=has_param(f"{_L}.{mlp}.up_proj.weight"),
                     why="the gated product is linear in up: up x c, down_proj / c")


def moe_residual(shared: str | None = None, qk_norm: bool = False) -> tuple[Move, ...]:
    """embed, o_proj, every down projection that writes into the residual (dense MLP, all experts, the
    shared expert): optional each, since a block has a dense MLP or experts (the probe then proves that
    every block's writes moved: a block left out changes the output)."""
    moves = (
        Move("model.embed_tokens.weight"),
        *biased(f"{_L}.self_attn.o_proj"),
        Move(f"{_L}.mlp.down_proj.weight", optional=True), Move(f"{_L}.mlp.down_proj.bias", optional=True),
        Move(f"{EXPERTS}.down_proj", optional=True),
        Move("model.norm.weight", -1, when=tied_head),
    )
    if shared:
        moves += (Move(f"{_L}.mlp.{shared}.down_proj.weight", optional=True),
                  Move(f"{_L}.mlp.{shared}.down_proj.bias", optional=True))
    if qk_norm:  # q/k norms read q_proj/k_proj outputs and share the eps: their inputs must scale too
        moves += (*biased(f"{_L}.self_attn.q_proj"), *biased(f"{_L}.self_attn.k_proj"))
    return moves


def moe_family(name: str, model_types: tuple[str, ...], intermediate: str, shared: str | None = None,
               qk_norm: bool = False, unfixable: str = "") -> Family:
    groups = [
        GroupSpec("residual", moe_residual(shared, qk_norm), eps_power=2,
                  why="the residual stream and every write into it (every expert's down_proj)"),
        *decoder_attention_pairs(qk_norm),
        mlp_up_down("mlp", "up_down"),
        expert_up_down(intermediate),
    ]
    if shared:
        groups.append(mlp_up_down(f"mlp.{shared}", "shared_up_down"))
    return Family(
        name=name,
        model_types=model_types,
        groups=tuple(groups),
        eps=(EpsScope(("rms_norm_eps",)),),
        unfixable=unfixable or ("gate pre-activations of every expert (scanned per expert) and of dense and shared MLPs "
                                "(SiLU is not homogeneous); raw QK^T logits under eager attention"),
        residual_writers=(LLAMA_BLOCK_WRITERS, MOE_BLOCK_WRITERS),  # dense layers (mlp_only_layers) and MoE layers
        shrink_widths=MOE_WIDTHS,
    )


# -- T5 stacks (families/t5.py, longt5.py) --------------------------------------------------------------------
T5_ENC, T5_DEC = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
T5_ENC_FF = f"{T5_ENC}.1.DenseReluDense"
T5_DEC_SELF, T5_DEC_CROSS, T5_DEC_FF = f"{T5_DEC}.0.SelfAttention", f"{T5_DEC}.1.EncDecAttention", f"{T5_DEC}.2.DenseReluDense"


def has_decoder(model) -> bool:
    """False for the encoder-only classes (T5EncoderModel, the usual text encoder of diffusion models)."""
    return getattr(model, "decoder", None) is not None


def relu_ff(model) -> bool:
    return not model.config.is_gated_act and model.config.dense_act_fn == "relu"


def gated_ff(model) -> bool:
    return model.config.is_gated_act


def weight(module: str, power: int = 1, when=None) -> Move:
    return Move(f"{module}.weight", power, when=when)


def _all(*conditions):
    conditions = [c for c in conditions if c is not None]
    return lambda model: all(c(model) for c in conditions)


def t5_stack_pairs(stack: str, attentions: dict[str, str], ff: str, when=None) -> tuple[GroupSpec, ...]:
    """The pairs inside one T5 stack's blocks: v/o and q/k per attention module, and the feed-forward pair."""
    specs = []
    for kind, attn in attentions.items():
        specs += [
            GroupSpec(f"{stack}_{kind}_vo", (weight(f"{attn}.v"), weight(f"{attn}.o", -1)), per_block=True, when=when,
                      why="attention is linear in V: v x c, o columns / c"),
            GroupSpec(f"{stack}_{kind}_qk", (weight(f"{attn}.q"), weight(f"{attn}.k", -1)), per_block=True, when=when,
                      why="QK^T (and so QK^T + position bias) is unchanged by q x c, k / c"),
        ]
    specs += [
        GroupSpec(f"{stack}_wi_wo", (weight(f"{ff}.wi"), weight(f"{ff}.wo", -1)), per_block=True, when=_all(when, relu_ff),
                  why="ReLU is positively homogeneous: wi x c, wo / c"),
        GroupSpec(f"{stack}_wi1_wo", (weight(f"{ff}.wi_1"), weight(f"{ff}.wo", -1)), per_block=True,
                  when=_all(when, gated_ff), why="the gated product is linear in wi_1: wi_1 x c, wo / c"),
    ]
    return tuple(specs)


# -- BART-style encoder-decoders (families/bart.py, pegasus.py) -----------------------------------------------
_BART_ENC, _BART_DEC = "model.encoder.layers", "model.decoder.layers"


def bart_relu(model) -> bool:
    return model.config.activation_function == "relu"


def bart_embeddings() -> tuple[Move, ...]:
    """Every token embedding table and both position tables (tied, the stacks' tables are `shared`)."""
    return (
        Move("model.shared.weight"),
        Move("model.encoder.embed_tokens.weight", optional=True), Move("model.decoder.embed_tokens.weight", optional=True),
        Move("model.encoder.embed_positions.weight"), Move("model.decoder.embed_positions.weight"),
    )


def _bart_attention_pairs(stack: str, attn: str, name: str) -> tuple[GroupSpec, ...]:
    a = f"{stack}.{{i}}.{attn}"
    return (
        GroupSpec(f"{name}_qk", (*linear(f"{a}.q_proj"), *linear(f"{a}.k_proj", -1)), per_block=True,
                  why="q x c, k / c leaves QK^T unchanged"),
        GroupSpec(f"{name}_vo", (*linear(f"{a}.v_proj"), Move(f"{a}.out_proj.weight", -1)), per_block=True,
                  why="attention is linear in V"),
    )


def _bart_fc_pair(stack: str, name: str) -> GroupSpec:
    layer = f"{stack}.{{i}}"
    return GroupSpec(f"{name}_fc", (*linear(f"{layer}.fc1"), Move(f"{layer}.fc2.weight", -1)), per_block=True,
                     when=bart_relu, why="relu(c x) = c relu(x)")


def bart_pairs() -> tuple[GroupSpec, ...]:
    """q/k and v/o per attention (encoder, decoder, cross), and the fc pair where the activation is relu."""
    return (*_bart_attention_pairs(_BART_ENC, "self_attn", "enc"), *_bart_attention_pairs(_BART_DEC, "self_attn", "dec"),
            *_bart_attention_pairs(_BART_DEC, "encoder_attn", "cross"), _bart_fc_pair(_BART_ENC, "enc"),
            _bart_fc_pair(_BART_DEC, "dec"))


# -- Gemma 2/3 language models (families/gemma.py, gemma3.py) -------------------------------------------------
def gemma_pairs(lm: str = "model") -> tuple[GroupSpec, ...]:
    """The v/o and up/down pairs of the language model under `lm` (Gemma 3 multimodal: model.language_model)."""
    layer = f"{lm}.layers.{{i}}"
    return (
        GroupSpec("vo", (*biased(f"{layer}.self_attn.v_proj"), Move(f"{layer}.self_attn.o_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows x c, o_proj columns / c"),
        GroupSpec("up_down", (*biased(f"{layer}.mlp.up_proj"), Move(f"{layer}.mlp.down_proj.weight", -1)), per_block=True,
                  why="the gated product is linear in up: up x c, down_proj / c"),
    )


def gemma_tied_head(lm: str = "model") -> Move:
    """A tied head reads the final (1+w) norm, which absorbs 1/s."""
    return Move(f"{lm}.norm.weight", -1, GAIN1P, when=tied_head)


def gemma_sandwich(q_k_norms: bool, lm: str = "model") -> tuple[Move, ...]:
    """The residual moves of a Gemma 2/3 language model under `lm`."""
    layer = f"{lm}.layers.{{i}}"
    moves = (
        Move(f"{lm}.embed_tokens.weight"),
        gain(f"{layer}.post_attention_layernorm"),
        gain(f"{layer}.post_feedforward_layernorm"),
        *biased(f"{layer}.self_attn.o_proj"),
        *biased(f"{layer}.mlp.down_proj"),
        gemma_tied_head(lm),
    )
    if q_k_norms:
        moves += (*biased(f"{layer}.self_attn.q_proj"), *biased(f"{layer}.self_attn.k_proj"))
    return moves


# -- T5Gemma stacks (families/t5gemma.py, t5gemma2.py) --------------------------------------------------------
def t5gemma_up_down(stack: str, layer: str) -> GroupSpec:
    return GroupSpec(f"{stack}_up_down", (*biased(f"{layer}.mlp.up_proj"), Move(f"{layer}.mlp.down_proj.weight", -1)),
                     per_block=True, why="gelu(gate) * up is linear in up: up x c, down_proj / c")
