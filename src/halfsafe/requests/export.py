"""`halfsafe export FORMAT CONVERTED OUT` as a request: the runtime profile resolved once."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import HalfsafeError
from ..runtime.profiles import RuntimeProfile, SplitK
from .common import TORCH, instance, path, switch

FORMATS = ("onnx", "gguf")


@dataclass(frozen=True)
class ExportRequest:
    converted: str | os.PathLike
    out: str | os.PathLike
    format: str = "onnx"
    overwrite: bool = False
    scan: bool = False  # a folder halfsafe did not convert: scan it briefly and say what it overflows
    runtime: RuntimeProfile = TORCH  # the graph's norms prescaled, its products split, as the profile needs
    llama_cpp: str | os.PathLike | None = None  # gguf: the llama.cpp whose converter runs (None: scripts/setup-llama-cpp's)
    split_k: SplitK | None = None  # onnx: how the graph's products are split (None: profiles.export_profile's default)

    def __post_init__(self) -> None:
        path("converted", self.converted)
        path("out", self.out)
        if not (isinstance(self.format, str) and self.format in FORMATS):
            raise HalfsafeError(f"export format {self.format!r:.60}: choose one of {', '.join(FORMATS)}")
        switch("overwrite", self.overwrite)
        switch("scan", self.scan)
        instance("runtime", self.runtime, RuntimeProfile, ": pass halfsafe.requests.runtime_profile(name)")
        path("llama_cpp", self.llama_cpp, optional=True)
        if self.format == "gguf" and (self.scan or self.runtime != TORCH):  # an unconverted folder is refused; llama.cpp's arithmetic is its own
            raise HalfsafeError(f"{'--scan' if self.scan else '--runtime'} is for export onnx: export gguf takes a converted folder as it is")
        if self.format != "gguf" and self.llama_cpp is not None:
            raise HalfsafeError("--llama-cpp is for export gguf")
        if self.split_k is not None:
            instance("split_k", self.split_k, SplitK, ": pass halfsafe.runtime.profiles.SplitK.parse(text)")
            if self.format == "gguf":
                raise HalfsafeError("--split-k is for export onnx: export gguf writes the checkpoint's tensors as they are")
