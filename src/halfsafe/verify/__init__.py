"""`verify`: how faithfully each way of running a model in 16 bits reproduces the float32 original.

Variants (the fp32 original is the reference; every other variant is compared to it on the same tokens):
- bf16, fp16: the original cast to that dtype (plain transformers, no custom code)
- fp16 clamp: fp16 with each residual add clamped to +-32752, as fp16 ONNX exports of Gemma 3 do (custom code)
- fp16 + fp32 residual: fp16 weights and matmuls, residual stream in fp32 (custom code)
- halfsafe fp16: the converted checkpoint loaded in fp16 (plain transformers), and with an fp32 residual

Per text and overall: non-finite logits, mean KL(fp32 || variant) per token, top-1 agreement, perplexity of the
text, max |logit error|, and how many greedily generated tokens match fp32's from the start of each text. Per
variant: parameter bytes and peak activation bytes of one forward pass, and the residual peak per block.

Modules: variants (what is compared, as data), compare (`verify`), runner (one variant over every text, the
reference cache, greedy generation), accumulator (per-token sums), memory (weight and activation bytes),
block_peaks (residual peak per block), converted (the converted folder), report (results, JSON, markdown,
environment), plots (the figures).
"""

from .accumulator import Accumulator as _Accumulator  # noqa: F401  (the metrics tests check these directly)
from .accumulator import matched_prefix as _matched_prefix  # noqa: F401
from .accumulator import nll_sum as _nll_sum  # noqa: F401
from .compare import verify
from .memory import parameter_bytes
from .plots import write_plots
from .report import Metrics, VariantResult, VerifyReport, environment, markdown_table
from .runner import greedy
from .variants import (
    ALL_VARIANTS,
    BASELINES,
    BF16,
    CLAMP,
    CONVERTED,
    FP16,
    FP32_RESIDUAL,
    HALFSAFE,
    HALFSAFE_FP32_RESIDUAL,
    REFERENCE,
    VARIANTS,
    Variant,
)

__all__ = [
    "ALL_VARIANTS", "BASELINES", "BF16", "CLAMP", "CONVERTED", "FP16", "FP32_RESIDUAL", "HALFSAFE", "HALFSAFE_FP32_RESIDUAL",
    "REFERENCE", "VARIANTS", "Metrics", "Variant", "VariantResult", "VerifyReport", "environment", "greedy", "markdown_table",
    "parameter_bytes", "verify", "write_plots",
]
