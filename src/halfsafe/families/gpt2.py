"""GPT-2: pre-norm residual, LayerNorm with bias, learned positions, GELU MLP, fused `attn.c_attn`.
`Conv1D` weights are [in, out] (y = x @ W + b), so a layer's outputs are *columns* of its weight.
`c_attn` columns are [q | k | v], hidden_size each, heads contiguous inside each part.

- residual: `wte`, `wpe`, every `attn.c_proj` and `mlp.c_proj` (weight and bias) x a, and the
  cross-attention `c_proj` where `add_cross_attention` (it reads the encoder's states and the
  invariant `ln_cross_attn` output); `layer_norm_epsilon` x a^2 (ln_1, ln_2, ln_cross_attn and ln_f all
  read the residual). `token_type_ids` go through `wte`, so they move too. Tied head (the default):
  logits = ln_f(h) @ wte^T, so `ln_f` weight AND bias / a cancel the x a of `wte`; untied: nothing.
- vo: the V columns of `c_attn` (and the V slice of its bias) x c, `attn.c_proj` rows / c.
- qk: the Q columns (and bias slice) x c, the K columns / c. QK^T is unchanged, so neither
  `scale_attn_weights`, `scale_attn_by_inverse_layer_idx` (a constant factor on the logits) nor
  `reorder_and_upcast_attn` (the same product in fp32) sees the pair.
- No MLP pair: c_fc feeds GELU (gelu_new by default), which is not homogeneous.
"""

from .spec import EpsScope, Family, GroupSpec, Move, tied_head

H = "transformer.h.{i}"
C_ATTN = f"{H}.attn.c_attn"


def _part(n: int):
    """The n-th hidden_size-wide part (0 q, 1 k, 2 v) of c_attn's outputs."""
    return lambda config: slice(n * config.hidden_size, (n + 1) * config.hidden_size)


def _c_attn_part(n: int, power: int) -> tuple[Move, ...]:
    return (Move(f"{C_ATTN}.weight", power, select=(1, _part(n))), Move(f"{C_ATTN}.bias", power, select=(0, _part(n))))


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    groups=(
        GroupSpec("residual", (
            Move("transformer.wte.weight"),
            Move("transformer.wpe.weight"),
            Move(f"{H}.attn.c_proj.weight"), Move(f"{H}.attn.c_proj.bias"),
            Move(f"{H}.mlp.c_proj.weight"), Move(f"{H}.mlp.c_proj.bias"),
            Move(f"{H}.crossattention.c_proj.weight", optional=True),
            Move(f"{H}.crossattention.c_proj.bias", optional=True),
            Move("transformer.ln_f.weight", -1, when=tied_head),
            Move("transformer.ln_f.bias", -1, when=tied_head),
        ), eps_power=2, why="the residual stream and every write into it"),
        GroupSpec("vo", (*_c_attn_part(2, 1), Move(f"{H}.attn.c_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: V columns of c_attn (and bias) x c, c_proj rows / c"),
        GroupSpec("qk", (*_c_attn_part(0, 1), *_c_attn_part(1, -1)), per_block=True,
                  why="QK^T is unchanged by Q columns x c, K columns / c"),
    ),
    eps=(EpsScope(("layer_norm_epsilon",)),),
    unfixable="mlp.c_fc pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention "
              "without reorder_and_upcast_attn",
    residual_writers=(("attn.c_proj", "mlp.c_proj"),),
)
