"""GPT-Neo: GPT-2's block with separate, bias-free q/k/v (`attn.attention.{q,k,v}_proj`), an
`out_proj` with bias, nn.Linear MLP (`c_fc`, `c_proj`), LayerNorm with bias, learned positions.
Its attention has no 1/sqrt(d) scaling and upcasts q and k to fp32 before QK^T (the eager and only
non-flash path), so the logits never exist in fp16; softmax(QK^T) @ V runs in the model dtype.

- residual: `wte`, `wpe`, every `attn.attention.out_proj` and `mlp.c_proj` (weight and bias) x a;
  `layer_norm_epsilon` x a^2 (ln_1, ln_2, ln_f all read the residual). Tied head (the default):
  `ln_f` weight AND bias / a; untied: nothing.
- vo: `v_proj` rows x c, `out_proj` columns / c (attention is linear in V; local attention only masks).
- qk: `q_proj` x c, `k_proj` / c: QK^T unchanged (the fp32 upcast is exact for fp16 inputs).
- No MLP pair: c_fc feeds GELU (gelu_new), which is not homogeneous.
"""

from .spec import EpsScope, Family, GroupSpec, Move, tied_head

H = "transformer.h.{i}"
A = f"{H}.attn.attention"

FAMILY = Family(
    name="gpt_neo",
    model_types=("gpt_neo",),
    groups=(
        GroupSpec("residual", (
            Move("transformer.wte.weight"),
            Move("transformer.wpe.weight"),
            Move(f"{A}.out_proj.weight"), Move(f"{A}.out_proj.bias"),
            Move(f"{H}.mlp.c_proj.weight"), Move(f"{H}.mlp.c_proj.bias"),
            Move("transformer.ln_f.weight", -1, when=tied_head),
            Move("transformer.ln_f.bias", -1, when=tied_head),
        ), eps_power=2, why="the residual stream and every write into it"),
        GroupSpec("vo", (Move(f"{A}.v_proj.weight"), Move(f"{A}.out_proj.weight", -1)), per_block=True,
                  why="attention is linear in V: v_proj x c, out_proj columns / c"),
        GroupSpec("qk", (Move(f"{A}.q_proj.weight"), Move(f"{A}.k_proj.weight", -1)), per_block=True,
                  why="QK^T is unchanged by q x c, k / c"),
    ),
    eps=(EpsScope(("layer_norm_epsilon",)),),
    unfixable="mlp.c_fc pre-activations (GELU is not homogeneous)",
    residual_writers=(("attn.attention.out_proj", "mlp.c_proj"),),
)
