"""Every module of family data, found in the package, and the model_type -> Family table built from them.

Adding a family: write `families/<name>.py` defining `FAMILY = Family(...)` (or `FAMILIES = (...)` for several),
and/or `REFUSED = {model_type: reason}` for architectures no exact rescale covers, and tiny configs for its model
types in tests/tiny/<name>.py. Every module of the package but the vocabulary, the builders, this one and the
package's own is family data (`family_modules`), so nothing else lists it. The table is checked as it is built: a
mistake in the data, or a module that holds none, stops the import of halfsafe.families with a message naming
the module.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module
from types import ModuleType

from .spec import Family

NOT_DATA = ("builders", "registry", "spec")  # the package's modules that hold no family (and its __init__)


class FamilyDataError(ValueError):
    """The family data contradicts itself (a model_type claimed twice, a module with no family, ...)."""


def family_modules() -> tuple[str, ...]:
    """Every family data module of the package, by name, sorted: the table is built in one order everywhere."""
    found = (m.name for m in pkgutil.iter_modules(import_module(__package__).__path__))
    return tuple(sorted(name for name in found if name not in NOT_DATA and not name.startswith("_")))


def load_modules(names: tuple[str, ...] | None = None) -> list[ModuleType]:
    """The family data modules `names` (every one in the package: `family_modules`), imported."""
    names = family_modules() if names is None else names
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise FamilyDataError(f"family modules listed twice: {', '.join(repeated)}")
    return [import_module(f"{__package__}.{name}") for name in names]


def _families_of(module: ModuleType) -> tuple[Family, ...]:
    where = module.__name__
    if hasattr(module, "FAMILY") and hasattr(module, "FAMILIES"):
        raise FamilyDataError(f"{where} defines both FAMILY and FAMILIES: keep one")
    families = module.FAMILIES if hasattr(module, "FAMILIES") else (module.FAMILY,) if hasattr(module, "FAMILY") else ()
    if not families and not getattr(module, "REFUSED", None):
        raise FamilyDataError(f"{where} defines no FAMILY, FAMILIES or REFUSED: it has no data to register (every module "
                              "of halfsafe/families is family data; helpers shared by families go in builders.py)")
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
