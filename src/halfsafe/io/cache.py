"""halfsafe's cache folder: $HALFSAFE_CACHE, by default ~/.cache/halfsafe (the built-in fixture, the key that signs
the marks of halfsafe's own folders beside OUT, the vLLM test environment). Imports nothing, so any module may ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HALFSAFE_CACHE", Path.home() / ".cache" / "halfsafe")).expanduser()
