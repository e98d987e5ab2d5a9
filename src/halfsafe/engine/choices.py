"""The engine's option vocabulary, without torch: the names of `--fp16-arith` (how the float16 trials compute,
halfsafe.engine.fp16_arith) and of `--calib-arith` (how the calibration's matrix products compute,
halfsafe.engine.calib_arith) with their defaults and checks, and the largest weight file written (engine.write).
The requests (halfsafe.requests) read their defaults and checks from here, so the command line builds its parser
without importing torch, and the engine needs nothing from the floors above it."""

from __future__ import annotations

from ..errors import HalfsafeError

# the shard size the hub's own serializer defaults to (huggingface_hub.serialization's MAX_SHARD_SIZE, "5GB");
# transformers 5's save_pretrained and push_to_hub default to 50GB per file, more than the hub and most tools expect.
# A checkpoint under 5 GB is one model.safetensors either way.
DEFAULT_MAX_SHARD_SIZE = "5GB"
AUTO, EMULATED, NATIVE = "auto", "emulated", "native"
FP16_ARITHS = (AUTO, EMULATED, NATIVE)  # how the float16 trials compute (halfsafe.engine.fp16_arith)
DEFAULT_FP16_ARITH = AUTO


def _check_choice(flag: str, asked: str | None, choices: tuple[str, ...], default: str) -> str:
    """An option of named choices as given (None: the default); an unknown name is a one-line error."""
    asked = default if asked is None else asked
    if asked not in choices:
        raise HalfsafeError(f"unknown {flag} {asked!r}: use {' or '.join(choices)}")
    return asked


def check_fp16_arith(asked: str | None) -> str:
    """The --fp16-arith option as given (None: the default); an unknown name is a one-line error."""
    return _check_choice("--fp16-arith", asked, FP16_ARITHS, DEFAULT_FP16_ARITH)


FLOAT32, BFLOAT16 = "float32", "bfloat16"
CALIB_ARITHS = (AUTO, FLOAT32, BFLOAT16)  # how the calibration's matrix products compute (halfsafe.engine.calib_arith)
DEFAULT_CALIB_ARITH = AUTO


def check_calib_arith(asked: str | None) -> str:
    """The --calib-arith option as given (None: the default); an unknown name is a one-line error."""
    return _check_choice("--calib-arith", asked, CALIB_ARITHS, DEFAULT_CALIB_ARITH)
