"""User-facing errors: one line that names the fix. The CLI prints them without a traceback.

Top level: the bottom floor; every other raises them, and the public API gives them.
"""


class HalfsafeError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class UnsupportedModelError(HalfsafeError):
    """The model's architecture has no rescaling data (or cannot be loaded at all)."""


class UnfixableOverflowError(HalfsafeError):
    """Some activation would still overflow float16 and no exact rescaling can move it."""
