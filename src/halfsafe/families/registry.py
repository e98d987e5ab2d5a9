"""Every module of family data, one line each, and the model_type -> Family table built from them.

Adding a family: write `families/<name>.py` defining `FAMILY = Family(...)` (or `FAMILIES = (...)` for several),
and/or `REFUSED = {model_type: reason}` for architectures no exact rescale covers; then add its line below and
tiny configs for its model types in tests/tiny/<name>.py. The table is checked as it is built: a mistake in
the data stops the import of halfsafe.families with a message naming the module.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from .spec import Family

FAMILY_MODULES = (
    "bart",
    "bert",
    "deepseek",
    "gemma",
    "gemma3",
    "gemma3n",
    "gemma4",
    "glm4",
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "gpt_oss",
    "llama",
    "longt5",
    "mixtral",
    "pegasus",
    "phi3",
    "qwen2_moe",
    "qwen2_vl",
    "qwen3",
    "qwen3_moe",
    "t5",
    "t5gemma",
    "t5gemma2",
)


class FamilyDataError(ValueError):
    """The family data contradicts itself (a model_type claimed twice, a module with no family, ...)."""


def load_modules(names: tuple[str, ...] = FAMILY_MODULES) -> list[ModuleType]:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise FamilyDataError(f"family modules listed twice in families/registry.py: {', '.join(repeated)}")
    return [import_module(f"{__package__}.{name}") for name in names]


def _families_of(module: ModuleType) -> tuple[Family, ...]:
    where = module.__name__
    if hasattr(module, "FAMILY") and hasattr(module, "FAMILIES"):
        raise FamilyDataError(f"{where} defines both FAMILY and FAMILIES: keep one")
    families = module.FAMILIES if hasattr(module, "FAMILIES") else (module.FAMILY,) if hasattr(module, "FAMILY") else ()
    if not families and not getattr(module, "REFUSED", None):
        raise FamilyDataError(f"{where} defines no FAMILY, FAMILIES or REFUSED: it has no data to register")
    for family in families:
        if not isinstance(family, Family):
            raise FamilyDataError(f"{where}: {family!r} is not a Family")
        if not family.model_types:
            raise FamilyDataError(f"{where}: family {family.name} names no model_type")
        if not family.residual_writers:
            raise FamilyDataError(f"{where}: family {family.name} lists no residual_writers (the modules each block "
                                  "adds to its residual stream)")
    return tuple(families)


def build(modules: list[ModuleType]) -> tuple[dict[str, Family], dict[str, str]]:
    """(model_type -> Family, model_type -> why it is refused), from the given data modules."""
    registry: dict[str, Family] = {}
    refused: dict[str, str] = {}
    owner: dict[str, str] = {}  # family name, or refused model_type -> the module defining it
    for module in modules:
        for family in _families_of(module):
            if family.name in owner:
                raise FamilyDataError(f"family name {family.name!r} is defined in {owner[family.name]} and {module.__name__}")
            owner[family.name] = module.__name__
            for model_type in family.model_types:
                if model_type in registry:
                    raise FamilyDataError(f"model_type {model_type!r} is claimed by {registry[model_type].name} and {family.name}")
                registry[model_type] = family
        for model_type, reason in getattr(module, "REFUSED", {}).items():
            if model_type in refused:
                raise FamilyDataError(f"model_type {model_type!r} is refused in {owner[model_type]} and {module.__name__}")
            if not isinstance(reason, str) or not reason.strip():
                raise FamilyDataError(f"{module.__name__}: REFUSED[{model_type!r}] needs a one-line reason")
            refused[model_type], owner[model_type] = reason, module.__name__
    both = sorted(set(registry) & set(refused))
    if both:
        raise FamilyDataError(f"model_type(s) both supported and refused: {', '.join(both)}")
    return registry, refused
