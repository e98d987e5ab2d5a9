"""The margin a plan keeps under 65504: for contexts up to `max_context` tokens, or `headroom_bits` as given
(halfsafe.core.margin's rule). Checked here, once; core.margin takes the numbers as they are."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import HalfsafeError
from .common import real, whole

MAX_HEADROOM_BITS = 16  # float16's exponents span 2^-14 .. 2^15: a margin of 16 bits leaves nothing


@dataclass(frozen=True)
class MarginOptions:
    max_context: int | None = None  # None: the model's longest context
    headroom_bits: float | None = None  # None: the margin for max_context

    def __post_init__(self) -> None:
        whole("--max-context", self.max_context, optional=True)
        real("--headroom-bits", self.headroom_bits, optional=True)
        if self.max_context is not None and self.max_context < 1:
            raise HalfsafeError(f"--max-context {self.max_context} is not a context length: pass a positive number of tokens")
        if self.headroom_bits is not None and not 0 <= self.headroom_bits < MAX_HEADROOM_BITS:
            raise HalfsafeError(f"--headroom-bits {self.headroom_bits} is out of range: use a number of bits from 0 to 15")
