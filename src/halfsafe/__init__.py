"""halfsafe: run bf16-pretrained models in float16 without inf/NaN, by exact power-of-two rescaling."""

__version__ = "0.1.0"

from .convert import ConversionReport, apply_plan_, convert_checkpoint, make_fp16_safe, plan_fp16_safe  # noqa: E402
from .errors import HalfsafeError, UnfixableOverflowError, UnsupportedModelError  # noqa: E402
from .families import family_for, supported_model_types  # noqa: E402
from .loading import load_model  # noqa: E402
from .plan import Plan  # noqa: E402
from .scan import ScanReport, scan  # noqa: E402


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
