"""The family registry: every data module of the package found, family modules independent of each other, mistakes
in the data (and a module of the package holding none) caught when the table is built, and the residual writers
each family lists found in its models."""

from __future__ import annotations

import ast
import pkgutil
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
from tiny import TINY, make_tiny

import halfsafe.families as families
from halfsafe.core.sites import find_blocks
from halfsafe.errors import HalfsafeError, UnsupportedModelError
from halfsafe.families import REFUSED, REGISTRY, family_for, supported_model_types
from halfsafe.families.registry import FamilyDataError, build, family_modules, load_modules
from halfsafe.families.spec import Family, GroupSpec, Move, StressHint
from halfsafe.runtime.baselines import residual_writers

PACKAGE = Path(families.__file__).parent
NOT_DATA = {"__init__", "spec", "builders", "registry"}


def test_every_data_module_of_the_package_is_found_once_in_order():
    on_disk = {m.name for m in pkgutil.iter_modules([str(PACKAGE)])} - NOT_DATA
    assert family_modules() == tuple(sorted(on_disk))
    every = {f.name for f in REGISTRY.values()} | set(REFUSED)
    assert {"llama", "gemma3_text", "t5", "gemma3n"} <= every  # one of each kind of module, registered


def test_a_module_of_the_package_without_data_fails_naming_it(monkeypatch, tmp_path):
    (tmp_path / "helpers.py").write_text('"""Helpers shared by families, put beside them instead of in builders.py."""\n')
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    try:
        assert "helpers" in family_modules()
        with pytest.raises(FamilyDataError, match=r"halfsafe\.families\.helpers defines no FAMILY.*builders\.py"):
            build(load_modules())
    finally:
        sys.modules.pop("halfsafe.families.helpers", None)


def test_family_modules_import_only_the_vocabulary_and_the_builders():
    for name in family_modules():
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
        assert {node.module for node in relative} <= {"spec", "builders"}, name
        private = [a.name for node in relative for a in node.names if a.name.startswith("_")]
        assert not private, f"{name} imports private names {private}"


def _module(name: str, **data) -> ModuleType:
    module = ModuleType(f"halfsafe.families.{name}")
    module.__dict__.update(data)
    return module


def _family(name: str, *model_types: str, writers=(("self_attn.o_proj", "mlp.down_proj"),)) -> Family:
    group = GroupSpec("residual", (Move("model.embed_tokens.weight"),))
    return Family(name=name, model_types=model_types, groups=(group,), residual_writers=writers)


def test_build_registers_families_and_refusals():
    registry, refused = build([_module("a", FAMILY=_family("a", "x", "y")),
                               _module("b", FAMILIES=(_family("b", "z"),), REFUSED={"w": "no exact rescale: why"})])
    assert sorted(registry) == ["x", "y", "z"] and registry["x"] is registry["y"]
    assert refused == {"w": "no exact rescale: why"}


@pytest.mark.parametrize("modules, message", [
    ([_module("a", FAMILY=_family("a", "x")), _module("b", FAMILY=_family("b", "x"))], "'x' is claimed by a and b"),
    ([_module("a", FAMILY=_family("a", "x")), _module("b", FAMILY=_family("a", "y"))], "family name 'a' is defined in"),
    ([_module("a")], "defines no FAMILY, FAMILIES or REFUSED"),
    ([_module("a", FAMILY=_family("a", "x"), FAMILIES=())], "both FAMILY and FAMILIES"),
    ([_module("a", FAMILY="llama")], "is not a Family"),
    ([_module("a", FAMILY=_family("a"))], "names no model_type"),
    ([_module("a", FAMILY=_family("a", "x", writers=()))], "lists no residual_writers"),
    ([_module("a", FAMILY=_family("a", "x"), REFUSED={"x": "why"})], "both supported and refused: x"),
    ([_module("a", REFUSED={"x": "why"}), _module("b", REFUSED={"x": "why"})], "refused in halfsafe.families.a and"),
    ([_module("a", REFUSED={"x": ""})], "needs a one-line reason"),
])
def test_build_fails_loudly_on_contradicting_data(modules, message):
    with pytest.raises(FamilyDataError, match=message.replace("(", r"\(")):
        build(modules)


def test_a_module_listed_twice_fails():
    with pytest.raises(FamilyDataError, match="listed twice.*llama"):
        load_modules(("llama", "t5", "llama"))


def test_writer_sets_are_checked_where_the_family_is_written():
    with pytest.raises(ValueError, match="can never be chosen"):  # the shorter set would always win
        _family("a", "x", writers=(("o_proj",), ("o_proj", "down_proj")))
    with pytest.raises(ValueError, match="tuples of module names"):  # a bare set, not a tuple of sets
        _family("a", "x", writers=("o_proj", "down_proj"))


def test_stress_hints_are_checked_where_the_family_is_written():
    with pytest.raises(ValueError, match="may hold"):  # a tower is a module, not a pair of blocks
        StressHint(towers=("model.layers.{i+1}",))
    with pytest.raises(ValueError, match="names both"):  # post-norm: the norms that write and what reads them
        StressHint(norms=("encoder.layer.{i}.output.LayerNorm",))


def test_unknown_and_refused_model_types_fail_with_the_fix():
    with pytest.raises(UnsupportedModelError) as e:
        family_for("no_such_model")
    text = str(e.value)
    assert "'no_such_model'" in text and ", ".join(supported_model_types()) in text
    assert "families/<name>.py" in text
    assert REFUSED, "gemma3n is refused with a reason"
    for model_type, reason in REFUSED.items():
        with pytest.raises(UnsupportedModelError, match="^" + re.escape(reason[:40])):
            family_for(model_type)
    assert supported_model_types() == sorted(REGISTRY)


@pytest.mark.parametrize("key", sorted(TINY))
def test_every_block_of_every_tiny_model_has_residual_writers(key):
    model = make_tiny(key)
    modules = dict(model.named_modules())
    writers = residual_writers(model)
    assert len(writers) >= 2 * len(find_blocks(model)) and all(w in modules for w in writers)


def test_a_block_without_known_writers_names_the_family_to_extend(monkeypatch):
    model = make_tiny("llama")
    monkeypatch.setitem(REGISTRY, "llama", replace(family_for("llama"), residual_writers=(("no.such.module",),)))
    with pytest.raises(HalfsafeError, match=r"no known residual writers in model\.layers\.0 .*residual_writers of family llama"):
        residual_writers(model)
