"""`halfsafe export FORMAT CONVERTED OUT` as a request: the runtime profile resolved once."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import HalfsafeError
from ..runtime.profiles import RuntimeProfile
from .common import TORCH, instance, path, switch

FORMATS = ("onnx",)


@dataclass(frozen=True)
class ExportRequest:
    converted: str | os.PathLike
    out: str | os.PathLike
    format: str = "onnx"
    overwrite: bool = False
    scan: bool = False  # a folder halfsafe did not convert: scan it briefly and say what it overflows
    runtime: RuntimeProfile = TORCH  # the graph's norms prescaled, its products split, as the profile needs

    def __post_init__(self) -> None:
        path("converted", self.converted)
        path("out", self.out)
        if not (isinstance(self.format, str) and self.format in FORMATS):
            raise HalfsafeError(f"export format {self.format!r:.60}: choose one of {', '.join(FORMATS)}")
        switch("overwrite", self.overwrite)
        switch("scan", self.scan)
        instance("runtime", self.runtime, RuntimeProfile, ": pass halfsafe.requests.runtime_profile(name)")
