"""Training with float16: exact rescales while training (optimizer trajectory kept), headroom logging
for the transformers Trainer, and a short penalty fine-tune where no exact rescale reaches."""

from .amp import TrainRun, train_steps
from .coordinates import TrainingRescaler, innermost_optimizer
from .headroom import PeakSampler, headroom_bits

__all__ = ["HeadroomCallback", "TrainingRescaler", "PeakSampler", "TrainRun", "train_steps", "headroom_bits",
           "innermost_optimizer", "FinetuneConfig", "FinetuneReport", "finetune_below_threshold", "finetune_checkpoint"]


def __getattr__(name):  # the Trainer callback and the fine-tune pull in more of transformers: load on use
    if name == "HeadroomCallback":
        from .callback import HeadroomCallback

        return HeadroomCallback
    if name in ("FinetuneConfig", "FinetuneReport", "finetune_below_threshold", "finetune_checkpoint"):
        from . import finetune

        return getattr(finetune, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
