"""Tiny random models, one module per family: each defines TINY = {model_type: config factory}.

Weights are randomised (norm gains and biases too, so every move is exercised) and rounded to
bfloat16, as a bf16-pretrained checkpoint's would be.
"""

from __future__ import annotations

import functools
import pkgutil
import random
from importlib import import_module

import torch
from transformers import PreTrainedModel

from halfsafe.engine.streamed import loads_whole
from halfsafe.io.loading import model_class_for


def _collect() -> dict:
    configs = {}
    for m in pkgutil.iter_modules(__path__):
        for key, factory in import_module(f"{__name__}.{m.name}").TINY.items():
            assert key not in configs, f"tiny config {key} defined twice"
            configs[key] = factory
    return configs


TINY = _collect()  # key (a model_type, or model_type plus a variant like "t5-v1_1") -> config factory


@functools.cache
def loaded_whole() -> frozenset[str]:
    """The keys whose saved checkpoint the engine loads whole, not streamed, decided as the engine decides it
    (engine.streamed.loads_whole: transformers splits some parameter on save, per-expert MoE weights)."""
    return frozenset(k for k, factory in TINY.items() if loads_whole(config := factory(), model_class_for(config)))


def streamable() -> list[str]:
    """The keys the engine streams, sorted."""
    return sorted(set(TINY) - loaded_whole())


@torch.no_grad()
def make_tiny(key: str, seed: int = 0, untie: bool = False) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = TINY[key]()
    if untie:  # composite configs (Gemma 3) tie by their text config's flag
        config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = False
    model = model_class_for(config)(config).float().eval()
    for p in model.parameters():
        if p.dim() == 1:
            p.add_(torch.randn_like(p) * 0.1)
        elif not p.any():  # initialised to zero (Gemma 3's image projection): a zero write would hide a missing move
            p.normal_(0, 0.02)
        p.copy_(p.bfloat16().float())
    for name, b in model.named_buffers():
        if b.is_floating_point() and "bias" in name:
            b.copy_(b.bfloat16().float())
    return model


def random_exponents(groups, seed: int = 0, choices=(-3, -2, -1, 1, 2, 3)) -> dict[str, int]:
    """A random power-of-two plan: one exponent per group, drawn from `choices` (reproducible by seed)."""
    rng = random.Random(seed)
    return {g.name: rng.choice(list(choices)) for g in groups}


def tiny_ids(model: PreTrainedModel, length: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(3, vocab, (1, length), generator=g)


def save_tiny(key: str, folder, seed: int = 0):
    """A tiny model as an ordinary checkpoint folder (config.json + model.safetensors), no tokenizer."""
    model = make_tiny(key, seed)
    model.save_pretrained(folder)
    return folder
