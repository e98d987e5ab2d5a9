from transformers import BertConfig, RobertaConfig

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               attn_implementation="eager")

TINY = {
    "bert": lambda: BertConfig(**_COMMON, max_position_embeddings=128, architectures=["BertForMaskedLM"]),
    # a classifier reading the pooler, relu MLP (the ffn pair): the other reader of the last LayerNorm
    "bert-cls-relu": lambda: BertConfig(**_COMMON, max_position_embeddings=128, hidden_act="relu",
                                        architectures=["BertForSequenceClassification"]),
    # positions start after the padding index (1), so the table holds 2 more rows than the longest input
    "roberta": lambda: RobertaConfig(**_COMMON, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                     architectures=["RobertaForMaskedLM"]),
}
