"""One frozen, typed request per command, built and checked once at the edge (the command line, or the Python API
function's keyword arguments) and handed down as it is: below the edge, nothing parses a name or checks an option
again. Every default is written here once; the command line's parser reads them. Nothing here imports torch."""

from .common import (
    CALIB_ARITHS,
    DEFAULT_CALIB_ARITH,
    DEFAULT_FP16_ARITH,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_MODEL,
    FP16_ARITHS,
    TORCH,
    EngineOptions,
    Fp16Options,
    TextOptions,
    check_calib_arith,
    check_fp16_arith,
    runtime_profile,
)
from .convert import APPLY_TEXT, CANDIDATES, CONVERT_TEXT, TARGETS, ApplyRequest, ConvertRequest, PlanOptions
from .export import FORMATS, ExportRequest
from .finetune import FINETUNE_TEXT, TRAIN_MODES, FinetuneConfig, FinetuneRequest
from .margin import MarginOptions
from .scan import SCAN_TEXT, TOP, ScanOptions, ScanRequest
from .verify import GREEDY_TOKENS, PROMPT_TOKENS, VERIFY_TEXT, VerifyRequest

__all__ = [
    "APPLY_TEXT", "CALIB_ARITHS", "CANDIDATES", "CONVERT_TEXT", "DEFAULT_CALIB_ARITH", "DEFAULT_FP16_ARITH", "DEFAULT_MAX_SHARD_SIZE", "DEFAULT_MODEL", "FINETUNE_TEXT",
    "FORMATS", "FP16_ARITHS", "GREEDY_TOKENS", "PROMPT_TOKENS", "SCAN_TEXT", "TARGETS", "TOP", "TORCH", "TRAIN_MODES",
    "VERIFY_TEXT", "ApplyRequest", "ConvertRequest", "EngineOptions", "ExportRequest", "FinetuneConfig",
    "FinetuneRequest", "Fp16Options", "MarginOptions", "PlanOptions", "ScanOptions", "ScanRequest", "TextOptions",
    "VerifyRequest", "check_calib_arith", "check_fp16_arith", "runtime_profile",
]
