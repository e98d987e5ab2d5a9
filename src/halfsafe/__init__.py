"""halfsafe: run bf16-pretrained models in float16 without inf/NaN, by exact power-of-two rescaling.

The pipeline, and where each step lives:
  load (io/: a folder, GGUF, the hub cache or the built-in model, inside its trust boundary)
  -> calibrate (calibration/: the embedded texts) -> scan (scan.py over core/stats: where float16 would overflow)
  -> probe (core/probe, core/shrink: which activations each group of families/ really moves)
  -> plan (core/plan: one power-of-two exponent per group) -> rewrite (core/rewrite: the one mutation)
  -> write (io/checkpoint, engine/write) -> verify (verify/: every variant against fp32).
convert/ runs that chain (convert/steps.py, a step a call); engine/ is how the data flows when the model is bigger
than memory (block by block); runtime/ runs a model in float16 somewhere (the pure-fp16 loader, the baselines,
runtime profiles); export/ and training/ start from a converted model.
"""

from ._version import __version__
from .convert import ConversionReport, apply_plan_, convert_checkpoint, make_fp16_safe, plan_fp16_safe
from .core.plan import Plan
from .errors import HalfsafeError, UnfixableOverflowError, UnsupportedModelError
from .families import family_for, supported_model_types
from .io.loading import load_model
from .scan import ScanReport, scan


def __getattr__(name):  # HeadroomCallback imports transformers' Trainer machinery: only when asked for
    if name == "HeadroomCallback":
        from .training.callback import HeadroomCallback

        return HeadroomCallback
    raise AttributeError(f"module 'halfsafe' has no attribute {name!r}")


__all__ = [
    "ConversionReport", "HalfsafeError", "HeadroomCallback", "Plan", "ScanReport", "UnfixableOverflowError", "UnsupportedModelError",
    "__version__", "apply_plan_", "convert_checkpoint", "family_for", "load_model", "make_fp16_safe",
    "plan_fp16_safe", "scan", "supported_model_types",
]
