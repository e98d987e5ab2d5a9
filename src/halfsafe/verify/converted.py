"""The converted checkpoint `verify` compares: checked against the original before the slow part starts, then
loaded as the all-float16 model a plain runtime would run (block by block from its shards where it can be)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..core.weights import compute_device
from ..errors import HalfsafeError
from ..io.loading import load_streamed, model_class_for, read_config
from ..io.trust import quiet_transformers
from ..runtime.fp16 import load_pure_fp16


def check_converted(converted: str | Path, original: PreTrainedModel) -> PretrainedConfig:
    """The converted folder's config, if it is a checkpoint of the original's architecture (checked up front)."""
    folder = Path(converted).expanduser()
    if not folder.is_dir():
        raise HalfsafeError(f"converted checkpoint {converted} is not a folder: give the output folder of `halfsafe convert`")
    config = read_config(folder)
    if config.model_type != original.config.model_type:
        raise HalfsafeError(
            f"{converted} is a {config.model_type!r} model but the original is {original.config.model_type!r}: "
            "give the checkpoint converted from this model"
        )
    return config


def load_converted(converted: str | Path, original: PreTrainedModel, stream: bool = False, device=None) -> PreTrainedModel:
    """The converted checkpoint in float16, every module float16 (transformers' fp32 islands turned off).
    `stream`: a block-by-block model (halfsafe.engine) loading its units in float16, where the checkpoint's layout
    allows; else (and when it does not) the whole model."""
    folder = Path(converted).expanduser()
    config = check_converted(converted, original)
    device = compute_device(original) if device is None else torch.device(device)
    model = _streamed_fp16(folder, config, device) if stream else None
    if model is not None:
        _check_parameters(model, original, converted)
        return model
    try:
        with quiet_transformers():
            model = load_pure_fp16(model_class_for(config), folder, local_files_only=True)
    except Exception as e:
        raise HalfsafeError(f"could not load the converted checkpoint in {folder} ({str(e).splitlines()[0][:200]})") from None
    _check_parameters(model, original, converted)
    return model.eval().to(device)


def _streamed_fp16(folder: Path, config: PretrainedConfig, device: torch.device) -> PreTrainedModel | None:
    """The converted folder as a streamed float16 model (as load_pure_fp16 computes: no module kept in float32
    but what transformers keeps so under every dtype), or None where it must be loaded whole."""
    return load_streamed(folder, config, device, torch.float16)  # for this model's life: it is made for the fp16 variants


def _check_parameters(model: PreTrainedModel, original: PreTrainedModel, converted) -> None:
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = {n: tuple(p.shape) for n, p in original.named_parameters()}
    if theirs != ours:
        raise HalfsafeError(f"{converted} does not have the original's parameters (names or shapes differ): give the checkpoint converted from this model")
