"""Loading a converted checkpoint as the all-float16 model it is, with no module quietly kept in float32.

transformers keeps every module a model class lists in `_keep_in_fp32_modules` in float32 whenever a checkpoint
is loaded with dtype=torch.float16 (T5, mT5, UMT5 list `wo`). For an unconverted bf16 T5 that keeps `wo` from
overflowing; but `wo`'s float32 output, added to the float16 residual, promotes the residual stream to float32
from the first feed-forward on: more memory, slower, not what an fp16-only runtime or export computes, and it
hides whether the float16 model is really safe. A halfsafe-converted checkpoint needs none of it.

In transformers 5, `from_pretrained` reads that list from the new model instance, which `post_init` fills from
the class attribute of the model and of every PreTrainedModel inside it (T5's encoder and decoder T5Stack)
while the model is being built. So the list must be emptied on the class that defines it (T5PreTrainedModel),
before loading: setting it on T5ForConditionalGeneration alone leaves T5Stack's `wo` in.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from ..io.trust import from_pretrained

_ATTR = "_keep_in_fp32_modules"


@contextmanager
def pure_fp16(model_class: type):
    """Within the block, `model_class.from_pretrained(..., dtype=torch.float16)` keeps no module in float32.

    It empties the list on every class `model_class` inherits it from, so while open it applies to every load
    of those classes in the process (not thread-safe). Auto classes pick their model class only inside
    `from_pretrained`, so for them this does nothing: use `load_pure_fp16`.
    """
    owners = {c: c.__dict__[_ATTR] for c in model_class.__mro__ if c.__dict__.get(_ATTR)}
    for c in owners:
        setattr(c, _ATTR, None)
    try:
        yield
    finally:
        for c, value in owners.items():
            setattr(c, _ATTR, value)


@torch.no_grad()
def load_pure_fp16(model_class: type, path, **kwargs) -> PreTrainedModel:
    """`model_class.from_pretrained(path, dtype=torch.float16, **kwargs)` with every floating parameter in float16.

    `model_class` may be a model class (T5ForConditionalGeneration) or an Auto class. Modules that an Auto class
    still kept in float32 are cast after loading: for a float16 checkpoint that is exact (float16 -> float32 ->
    float16), otherwise it is the same single rounding a direct float16 load does; it only costs their float32
    size in memory for a moment.
    """
    with pure_fp16(model_class):
        model = from_pretrained(model_class, path, dtype=torch.float16, **kwargs)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float16:
            p.data = p.data.to(torch.float16)
    return model
