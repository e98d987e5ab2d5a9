"""GPT-NeoX (Pythia): LayerNorm with bias, GELU MLP, partial RoPE, fused `attention.query_key_value`
whose output rows are laid out per head as [q, k, v] (view(..., heads, 3*head_size).chunk(3)), and
either a parallel residual (h + attn(ln1 h) + mlp(ln2 h)) or a sequential one; both read the
residual only through LayerNorms and write it only through `attention.dense` and `dense_4h_to_h`.
The head is untied by default (`embed_out` on disk, renamed to and from `lm_head` by transformers).

- residual: `embed_in`, every `attention.dense` and `mlp.dense_4h_to_h` (weight and bias) x a;
  `layer_norm_eps` x a^2. Untied head: nothing (it reads `final_layer_norm`'s invariant output);
  tied: `final_layer_norm` weight AND bias / a.
- vo: the V rows of each head in `query_key_value` (and bias) x c, `attention.dense` columns / c.
- qk: the Q rows of each head (and bias) x c, the K rows / c. Partial rotary (rotary_pct) rotates the
  first rotary_ndims dims of q and of k by the same position-dependent linear map and passes the rest
  through: q x c, k / c still leaves every logit q.k unchanged.
- No MLP pair: dense_h_to_4h feeds GELU, which is not homogeneous.
"""

from .spec import EpsScope, Family, GroupSpec, Move, tied_head

L = "gpt_neox.layers.{i}"
QKV = f"{L}.attention.query_key_value"


def _rows(n: int):
    """Rows of part n (0 q, 1 k, 2 v) of every head in query_key_value."""
    def index(config) -> list[int]:
        d = config.hidden_size // config.num_attention_heads
        return [h * 3 * d + n * d + j for h in range(config.num_attention_heads) for j in range(d)]
    return index


def _qkv_part(n: int, power: int) -> tuple[Move, ...]:
    return (Move(f"{QKV}.weight", power, select=(0, _rows(n))),
            Move(f"{QKV}.bias", power, optional=True, select=(0, _rows(n))))


FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    groups=(
        GroupSpec("residual", (
            Move("gpt_neox.embed_in.weight"),
            Move(f"{L}.attention.dense.weight"), Move(f"{L}.attention.dense.bias", optional=True),
            Move(f"{L}.mlp.dense_4h_to_h.weight"), Move(f"{L}.mlp.dense_4h_to_h.bias"),
            Move("gpt_neox.final_layer_norm.weight", -1, when=tied_head),
            Move("gpt_neox.final_layer_norm.bias", -1, when=tied_head),
        ), eps_power=2, why="the residual stream and every write into it"),
        GroupSpec("vo", (*_qkv_part(2, 1), Move(f"{L}.attention.dense.weight", -1)), per_block=True,
                  why="attention is linear in V: V rows of query_key_value (and bias) x c, dense columns / c"),
        GroupSpec("qk", (*_qkv_part(0, 1), *_qkv_part(1, -1)), per_block=True,
                  why="QK^T is unchanged by Q rows x c, K rows / c (partial RoPE is linear)"),
    ),
    eps=(EpsScope(("layer_norm_eps",)),),
    unfixable="mlp.dense_h_to_4h pre-activations (GELU is not homogeneous); raw QK^T logits under eager attention",
    residual_writers=(("attention.dense", "mlp.dense_4h_to_h"),),  # parallel or sequential residual
)
