"""One forward pass for any supported model kind (decoder-only, encoder-only, encoder-decoder)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

HEAD_CHUNK = 64  # positions per lm_head call when the head is run apart from the body


def is_encoder_decoder(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def model_inputs(model: PreTrainedModel, ids: torch.Tensor | Mapping) -> dict:
    """Encoder-decoder models are teacher-forced: the decoder reads the same text shifted right. A sample may
    also be a dict of model inputs (input_ids with pixel_values and the like, for a vision-language model),
    passed as it is."""
    extra = {}
    if isinstance(ids, Mapping):
        extra = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in ids.items()}
        ids = extra.pop("input_ids")
    ids = ids.to(model.device)
    if not is_encoder_decoder(model):
        return {"input_ids": ids, **extra}
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(model.config, "pad_token_id", None) or 0
    decoder_ids = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
    return {"input_ids": ids, "decoder_input_ids": decoder_ids, **extra}


def prefix(sample: torch.Tensor | dict, n: int) -> torch.Tensor | dict:
    """The first n tokens of a sample; a dict sample (text with image inputs) whole, since its image tokens
    must stay with their pixels."""
    return sample if isinstance(sample, dict) else sample[:, :n]


@torch.no_grad()
def logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Output logits [batch, seq, vocab] (or the last hidden state for headless models)."""
    out = model(**model_inputs(model, ids), use_cache=False)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@torch.no_grad()
def run_for_stats(model: PreTrainedModel, ids: torch.Tensor) -> None:
    """A forward pass whose activations are measured. For standard causal LMs the body runs once and
    the LM head runs on chunks of positions: every head output is still seen by the hooks, but the
    [seq, vocab] logits never exist whole (262k vocab x 512 tokens is 0.5 GB in fp32)."""
    base = getattr(model, model.base_model_prefix, None) if model.base_model_prefix else None
    head = model.get_output_embeddings()
    standard_causal = "logits_to_keep" in inspect.signature(model.forward).parameters
    if not standard_causal or base is None or base is model or head is None or is_encoder_decoder(model):
        model(**model_inputs(model, ids), use_cache=False)
        return
    hidden = base(**model_inputs(model, ids), use_cache=False).last_hidden_state
    for chunk in hidden.split(HEAD_CHUNK, dim=1):
        head(chunk)
