"""halfsafe: run bf16-pretrained models in float16 without inf/NaN, by exact power-of-two rescaling."""

__version__ = "0.1.0"

from .errors import HalfsafeError, UnfixableOverflowError, UnsupportedModelError  # noqa: E402
from .loading import load_model  # noqa: E402
from .scan import ScanReport, scan  # noqa: E402

__all__ = ["HalfsafeError", "UnfixableOverflowError", "UnsupportedModelError", "load_model", "scan", "ScanReport", "__version__"]
