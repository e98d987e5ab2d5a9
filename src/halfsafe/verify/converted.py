"""The converted checkpoint `verify` compares: checked against the original before the slow part starts, then
loaded as the all-float16 model a plain runtime would run."""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig, PreTrainedModel

from ..errors import HalfsafeError
from ..loading import model_class_for, quiet_transformers, read_config
from ..runtime import load_pure_fp16


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


def load_converted(converted: str | Path, original: PreTrainedModel) -> PreTrainedModel:
    """The converted checkpoint in float16, every module float16 (transformers' fp32 islands turned off)."""
    folder = Path(converted).expanduser()
    config = check_converted(converted, original)
    try:
        with quiet_transformers():
            model = load_pure_fp16(model_class_for(config), folder, local_files_only=True)
    except Exception as e:
        raise HalfsafeError(f"could not load the converted checkpoint in {folder} ({str(e).splitlines()[0][:200]})") from None
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = {n: tuple(p.shape) for n, p in original.named_parameters()}
    if theirs != ours:
        raise HalfsafeError(f"{converted} does not have the original's parameters (names or shapes differ): give the checkpoint converted from this model")
    return model.eval().to(original.device)
