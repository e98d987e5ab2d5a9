"""One forward pass for any supported model kind (decoder-only, encoder-only, encoder-decoder, image-text).

Image-text models with a fixed number of image tokens per image (Gemma 3: `mm_tokens_per_image`) see one
synthetic image, a deterministic colour gradient, placed after the first text token as their processor would
place it ([boi] + image tokens + [eoi]): every forward pass here (scan, probe, plan, verify) then runs the vision
tower and the projector with the language model, and `logits` returns the text positions only, so outputs
line up with the text ids as for a text-only model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

from .weights import compute_device, weights_of

# positions per lm_head call when the head is run apart from the body: as many as keep one call's float32 logits
# within HEAD_CHUNK_BYTES, at least HEAD_CHUNK. Fewer calls matter where the head is read a slice at a time
# (engine.wide): every call reads the whole head again (a 32000-token vocabulary: 512 positions in one call).
HEAD_CHUNK = 64
HEAD_CHUNK_BYTES = 64 << 20


def head_chunk(vocab: int) -> int:
    """Positions per lm_head call for a head of `vocab` outputs (float32 logits); HEAD_CHUNK where that is unknown (0)."""
    return max(HEAD_CHUNK, HEAD_CHUNK_BYTES // (4 * vocab)) if vocab > 0 else HEAD_CHUNK


def is_encoder_decoder(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def gradient_image(size: int, channels: int = 3) -> torch.Tensor:
    """[1, channels, size, size] in [-1, 1] (SigLIP's normalised range): channel c ramps along a different
    direction (x, y, the diagonal), so every patch differs."""
    r = torch.linspace(-1.0, 1.0, size)
    y, x = torch.meshgrid(r, r, indexing="ij")
    ramps = [x, y, (x + y) / 2]
    return torch.stack([ramps[c % 3] for c in range(channels)])[None]


def image_prompt(model: PreTrainedModel) -> tuple[list, list[int], torch.Tensor] | None:
    """(ids, token types, pixel_values) of the synthetic image for an image-text model; None for other models."""
    config = model.config
    vision, n = getattr(config, "vision_config", None), getattr(config, "mm_tokens_per_image", None)
    if vision is None or n is None or getattr(config, "image_token_id", None) is None:
        return None
    boi, eoi = getattr(config, "boi_token_id", None), getattr(config, "eoi_token_id", None)
    ids = [boi] * (boi is not None) + [config.image_token_id] * n + [eoi] * (eoi is not None)
    types = [0] * (boi is not None) + [1] * n + [0] * (eoi is not None)
    return ids, types, gradient_image(vision.image_size, getattr(vision, "num_channels", 3))


def _synthetic_image(model: PreTrainedModel, sample) -> tuple | None:
    """The synthetic image a text sample gets; none for a dict sample (it brings its own inputs) or an
    encoder-decoder."""
    if isinstance(sample, Mapping) and sample or is_encoder_decoder(model):
        return None
    return image_prompt(model)


def model_inputs(model: PreTrainedModel, ids: torch.Tensor | Mapping) -> dict:
    """Encoder-decoder models are teacher-forced: the decoder reads the same text shifted right. A sample may
    also be a dict of model inputs (input_ids with pixel_values and the like, for a vision-language model),
    passed as it is. Without one, image-text models get the synthetic image after the first token (see the
    module's docstring)."""
    extra, device = {}, compute_device(model)
    if isinstance(ids, Mapping):
        extra = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in ids.items()}
        ids = extra.pop("input_ids")
    ids = ids.to(device)
    image = _synthetic_image(model, extra)
    if image is not None:
        block, types, pixels = image
        block = torch.tensor([block] * ids.shape[0], device=ids.device, dtype=ids.dtype)
        types = torch.tensor([types] * ids.shape[0], device=ids.device, dtype=ids.dtype)
        ids = torch.cat([ids[:, :1], block, ids[:, 1:]], dim=1)
        token_types = torch.cat([torch.zeros_like(ids[:, :1]), types, torch.zeros_like(ids[:, block.shape[1] + 1:])], dim=1)
        dtype = next(model.parameters()).dtype
        return {"input_ids": ids, "token_type_ids": token_types,
                "pixel_values": pixels.expand(ids.shape[0], -1, -1, -1).to(device, dtype)}
    if not is_encoder_decoder(model):
        return {"input_ids": ids, **extra}
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(model.config, "pad_token_id", None) or 0
    decoder_ids = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
    return {"input_ids": ids, "decoder_input_ids": decoder_ids, **extra}


def sample_tokens(sample: torch.Tensor | Mapping) -> int:
    """Text tokens in one sample (a [1, n] id tensor, or a dict sample's input_ids)."""
    return (sample["input_ids"] if isinstance(sample, Mapping) else sample).shape[-1]


def prefix(sample: torch.Tensor | Mapping, n: int) -> torch.Tensor | Mapping:
    """The first n tokens of a sample; a dict sample (text with image inputs) whole, since its image tokens
    must stay with their pixels."""
    return sample if isinstance(sample, Mapping) else sample[:, :n]


@torch.no_grad()
def logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Output logits [batch, seq, vocab] (or the last hidden state for headless models)."""
    out = model(**model_inputs(model, ids), use_cache=False)
    out = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    image = _synthetic_image(model, ids)
    if image is not None:  # the text positions only
        out = torch.cat([out[:, :1], out[:, 1 + len(image[0]):]], dim=1)
    return out


@torch.no_grad()
def run_for_stats(model: PreTrainedModel, ids: torch.Tensor, shared_head=None) -> None:
    """A forward pass whose activations are measured. For standard causal LMs the body runs once and
    the LM head runs on chunks of positions: every head output is still seen by the hooks, but the
    [seq, vocab] logits never exist whole (262k vocab x 512 tokens is 0.5 GB in fp32). `shared_head`
    (engine.shared_head.SharedHead, where the scan has one) takes the last hidden state instead, and runs the
    head once for every sample of the pass."""
    base = getattr(model, model.base_model_prefix, None) if model.base_model_prefix else None
    head = model.get_output_embeddings()
    standard_causal = "logits_to_keep" in inspect.signature(model.forward).parameters
    if not standard_causal or base is None or base is model or head is None or is_encoder_decoder(model):
        model(**model_inputs(model, ids), use_cache=False)
        return
    with weights_of(model).held():  # a streamed model's head loads once, not once per chunk
        hidden = base(**model_inputs(model, ids), use_cache=False).last_hidden_state
        if shared_head is not None:
            shared_head.take(hidden)
            return
        for chunk in hidden.split(head_chunk(getattr(head, "out_features", 0)), dim=1):
            head(chunk)
