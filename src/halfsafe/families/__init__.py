"""Architecture knowledge, one data module per family, looked up by `config.model_type`.

Every module of the package is found by families/registry.py (adding a family: see there); shared templates and
helpers live in families/builders.py, the vocabulary in families/spec.py. `REFUSED` holds the model types that no
exact rescale covers, with the reason family_for gives for each.
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .registry import build, load_modules
from .spec import GAIN1P, MUL, Family, GroupSpec, Move

REGISTRY, REFUSED = build(load_modules())  # model_type -> Family; model_type -> why no exact rescale covers it


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def family_for(model_type: str) -> Family:
    if model_type in REFUSED:
        raise UnsupportedModelError(REFUSED[model_type])
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"no rescaling data for model_type {model_type!r}; supported: {', '.join(supported_model_types())}. "
            "To add it, write src/halfsafe/families/<name>.py (see families/llama.py and CONTRIBUTING.md)"
        ) from None


__all__ = ["Family", "GroupSpec", "Move", "MUL", "GAIN1P", "REGISTRY", "REFUSED", "family_for", "supported_model_types"]
