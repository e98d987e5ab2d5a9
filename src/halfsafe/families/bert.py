"""BERT and RoBERTa: post-norm encoders, LayerNorm with weight and bias (eps from `layer_norm_eps`, shared by
every norm), GELU MLP, separate q/k/v. Layer i (`<base>.encoder.layer.{i}`), reading h:

  e  = LN_emb(word[ids] + position[pos] + token_type[tt])         embeddings.LayerNorm
  y  = LN_a(dense_a(attn(query h, key h, value h)) + h)           attention.output.{dense,LayerNorm}
  h' = LN_o(dense_o(gelu(intermediate y)) + y)                    output.{dense,LayerNorm}

Every sub-layer ends in a LayerNorm, so no scale runs through the model. What moves is each LayerNorm's
output, by its own c: the LayerNorm's weight and bias x c; every Linear that reads it, weight / c
(W (c x) / c + b = W x + b: its bias stays); and the branch output added to it before the next LayerNorm,
weight and bias x c. The next LayerNorm then reads c times its old input and puts out what it did, up
to its eps (LN(c x) with eps is LN(x) with eps / c**2; the shared `layer_norm_eps` cannot follow, since
the norms take different c, but 1e-12 is far below any variance: random plans on the tiny models change
nothing, to the bit). One group per LayerNorm:
- embeddings: word, position and token-type embeddings x s scale the embedding LayerNorm's input. A tied
  MLM decoder (it is the word embedding) is compensated in the head's own LayerNorm
  (`cls.predictions.transform.LayerNorm`, RoBERTa `lm_head.layer_norm`) / s, whose output only the decoder
  reads; the decoder's bias stays.
- ln_emb: the embedding LayerNorm's output, read by layer 0 (q/k/v / c, attention.output.dense x c).
- ln_attn (per layer): attention.output.LayerNorm's output y, read by intermediate.dense (/ c) and added
  to output.dense's output (x c).
- ln_out (per layer i < n-1, `{i+1}`): output.LayerNorm's output, read by layer i+1 (q/k/v / c) and added
  to its attention.output.dense (x c).
- ln_last: the last layer's output.LayerNorm. Only in model classes whose every reader of the final hidden
  state is an ordinary Linear (the MLM head transform, the pooler, a classifier): never in the bare model,
  whose output it is.
- qk (per layer): query x c, key / c (weights and biases) leaves every score unchanged.
- vo (per layer): value x c (weight and bias), attention.output.dense weight / c: attention is linear in V.
- ffn (per layer, only with hidden_act "relu"): intermediate x c, output.dense weight / c.
Layers with cross-attention (`add_cross_attention`, decoder configs) get no ln_attn group: y also feeds the
cross-attention, which this data does not move; every other group stays exact there.
"""

from .builders import class_in, linear, norm
from .spec import ONNX_ENCODER, Family, GroupSpec, Move, OnnxExport, StressHint, tied_head


def _reads(layer: str) -> tuple[Move, ...]:
    """A LayerNorm output entering `layer`: its q/k/v read it, attention.output.dense is added to it."""
    return (*(Move(f"{layer}.attention.self.{p}.weight", -1) for p in ("query", "key", "value")),
            *linear(f"{layer}.attention.output.dense"))


def _no_cross_attention(model) -> bool:
    return not getattr(model.config, "add_cross_attention", False)


def _relu(model) -> bool:
    return model.config.hidden_act == "relu"


def encoder_family(name: str, base: str, head_norm: str, final_readers: dict[str, tuple[str, ...]]) -> Family:
    """`final_readers`: model class -> the Linear layers (other than the pooler) that read the last hidden state."""
    emb, L, N = f"{base}.embeddings", f"{base}.encoder.layer.{{i}}", f"{base}.encoder.layer.{{i+1}}"
    last = f"{base}.encoder.layer.{{last}}"
    readers = sorted({r for rs in final_readers.values() for r in rs})
    groups = (
        GroupSpec("embeddings", (
            Move(f"{emb}.word_embeddings.weight"), Move(f"{emb}.position_embeddings.weight"),
            Move(f"{emb}.token_type_embeddings.weight", optional=True),
            *norm(head_norm, -1, when=tied_head),
        ), why="the embedding sum is normalized; a tied decoder is undone in the head's LayerNorm"),
        GroupSpec("ln_emb", (*norm(f"{emb}.LayerNorm"), *_reads(f"{base}.encoder.layer.0")),
                  why="the embedding LayerNorm's output, read by layer 0"),
        GroupSpec("ln_attn", (*norm(f"{L}.attention.output.LayerNorm"), Move(f"{L}.intermediate.dense.weight", -1),
                              *linear(f"{L}.output.dense")), per_block=True, when=_no_cross_attention,
                  why="attention LayerNorm output: intermediate / c, output.dense x c"),
        GroupSpec("ln_out", (*norm(f"{L}.output.LayerNorm"), *_reads(N)), per_block=True,
                  why="a layer's output LayerNorm, read by the next layer"),
        GroupSpec("ln_last", (
            *norm(f"{last}.output.LayerNorm"),
            Move(f"{base}.pooler.dense.weight", -1, optional=True),
            *(Move(f"{r}.weight", -1, when=class_in(c for c, rs in final_readers.items() if r in rs)) for r in readers),
        ), when=class_in(final_readers), why="the last LayerNorm, read only by the head's Linear layers"),
        GroupSpec("qk", (*linear(f"{L}.attention.self.query"), *linear(f"{L}.attention.self.key", -1)), per_block=True,
                  why="q x c, k / c leaves QK^T unchanged"),
        GroupSpec("vo", (*linear(f"{L}.attention.self.value"), Move(f"{L}.attention.output.dense.weight", -1)),
                  per_block=True, why="attention is linear in V"),
        GroupSpec("ffn", (*linear(f"{L}.intermediate.dense"), Move(f"{L}.output.dense.weight", -1)), per_block=True,
                  when=_relu, why="relu(c x) = c relu(x)"),
    )
    return Family(
        name=name,
        model_types=(name,),
        groups=groups,
        unfixable=("intermediate.dense pre-activations and outputs (GELU is not homogeneous, so nothing pairs "
                   "intermediate with output.dense); raw QK^T logits under eager attention"),
        residual_writers=(("attention.output.dense", "output.dense"),),  # post-norm: LayerNorm(write + residual)
        notes="each moved LayerNorm input sees its eps as eps / c**2 (layer_norm_eps 1e-12: negligible)",
        # the stream: the embedding LayerNorm's output, then each sub-layer's; read by every layer's query and key
        stress=StressHint(norms=(f"{emb}.LayerNorm", f"{L}.attention.output.LayerNorm", f"{L}.output.LayerNorm"),
                           reads=(f"{L}.attention.self.query", f"{L}.attention.self.key")),
        onnx=OnnxExport(ONNX_ENCODER),  # the bare model (feature-extraction) and the masked LM (fill-mask)
    )


_BERT_MLM = ("cls.predictions.transform.dense",)
BERT = encoder_family("bert", "bert", "cls.predictions.transform.LayerNorm", {
    "BertForMaskedLM": _BERT_MLM, "BertLMHeadModel": _BERT_MLM, "BertForPreTraining": _BERT_MLM,
    "BertForSequenceClassification": (), "BertForMultipleChoice": (), "BertForNextSentencePrediction": (),
    "BertForTokenClassification": ("classifier",), "BertForQuestionAnswering": ("qa_outputs",),
})
ROBERTA = encoder_family("roberta", "roberta", "lm_head.layer_norm", {
    "RobertaForMaskedLM": ("lm_head.dense",), "RobertaForCausalLM": ("lm_head.dense",),
    "RobertaForSequenceClassification": ("classifier.dense",), "RobertaForMultipleChoice": (),
    "RobertaForTokenClassification": ("classifier",), "RobertaForQuestionAnswering": ("qa_outputs",),
})
FAMILIES = (BERT, ROBERTA)
