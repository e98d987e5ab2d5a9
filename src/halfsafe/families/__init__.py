"""Architecture knowledge, one data module per family, looked up by `config.model_type`.

Adding a family: write `families/<name>.py` defining `FAMILY = Family(...)` (or `FAMILIES`; every module here is
read), and add tiny configs for its model types in tests/tiny/<name>.py. A module may instead (or also) define
`REFUSED = {model_type: reason}` for an architecture no exact rescale covers: family_for raises with that reason.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module

from ..errors import UnsupportedModelError
from .spec import GAIN1P, MUL, Family, GroupSpec, Move

def _family_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "spec")


def _load_registry() -> dict[str, Family]:
    registry: dict[str, Family] = {}
    for mod in _family_modules():
        module = import_module(f"{__name__}.{mod}")
        REFUSED.update(getattr(module, "REFUSED", {}))
        for family in getattr(module, "FAMILIES", None) or ((module.FAMILY,) if hasattr(module, "FAMILY") else ()):
            for model_type in family.model_types:
                if model_type in registry:
                    raise ValueError(f"model_type {model_type!r} claimed by {registry[model_type].name} and {family.name}")
                registry[model_type] = family
    return registry


REFUSED: dict[str, str] = {}  # model_type -> why no exact rescale covers it (one line)
REGISTRY = _load_registry()


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def family_for(model_type: str) -> Family:
    if model_type in REFUSED and model_type not in REGISTRY:
        raise UnsupportedModelError(REFUSED[model_type])
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"no rescaling data for model_type {model_type!r}; supported: {', '.join(supported_model_types())}. "
            "To add it, write src/halfsafe/families/<name>.py (see families/llama.py)"
        ) from None


__all__ = ["Family", "GroupSpec", "Move", "MUL", "GAIN1P", "REGISTRY", "family_for", "supported_model_types"]
