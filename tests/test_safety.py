"""What halfsafe promises about its input, held against hostile folders built here: nothing is read from outside
MODEL and nothing it ships is run; MODEL is never written, replaced or deleted. Property tests (hypothesis) over
plan dicts and safetensors headers: any input gives a correct result or a one-line error with exit 2, never a
traceback, never a changed input folder. (Corrupt input and bad options: test_errors.py; --overwrite and racing
runs: test_faults.py; plans that do not fit or would zero a model: test_apply.py.)"""

from __future__ import annotations

import ast
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hostile import SHORT, copy_of, folder_hash, refused, tiny_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tiny import make_tiny, save_tiny

import halfsafe
from halfsafe.cli import main
from halfsafe.core.plan import Plan
from halfsafe.errors import HalfsafeError

PROPERTY = settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def model(tiny, tmp_path) -> Path:
    return copy_of(tiny, tmp_path / "model")


# --- nothing read from outside MODEL ----------------------------------------------------------------------------


def _index_naming(folder: Path, target: str) -> None:
    keys = list(load_file(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: target for k in keys}}))
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("target", ["../../../etc/passwd", "/etc/passwd", "../outside.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(model, capsys, target):
    (model.parent / "outside.safetensors").write_bytes((model / "model.safetensors").read_bytes())  # a real checkpoint there
    _index_naming(model, target)
    before = folder_hash(model)
    refused(capsys, ["scan", str(model), *SHORT], "outside the model folder", target)
    assert folder_hash(model) == before


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_symlink_pointing_outside_the_folder_is_refused(model, capsys, name):
    outside = model.parent / f"elsewhere-{name}"
    (model / name).rename(outside) if (model / name).exists() else outside.write_text("{}")
    (model / name).symlink_to(outside)
    refused(capsys, ["scan", str(model), *SHORT], "outside the model folder")


def test_a_symlink_inside_the_folder_is_followed(model, capsys):
    (model / "weights").mkdir()
    (model / "model.safetensors").rename(model / "weights" / "w.safetensors")
    (model / "model.safetensors").symlink_to("weights/w.safetensors")
    assert main(["scan", str(model), *SHORT]) == 0


def _evil(folder: Path, marker: Path) -> None:
    """Python in the folder that would leave `marker` if anything imported it."""
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n")


@pytest.mark.parametrize("where, model_type", [("config.json", "llama"), ("config.json", "evil_arch"),
                                               ("tokenizer_config.json", "llama")])
def test_a_folder_asking_for_its_own_code_is_refused_without_a_prompt(model, tmp_path, capsys, where, model_type):
    marker = tmp_path / "code-ran"
    _evil(model, marker)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    extra = json.loads((model / where).read_text()) if (model / where).exists() else {}
    (model / where).write_text(json.dumps({**extra, "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.T", None]}}))
    refused(capsys, ["scan", str(model), *SHORT], "auto_map", "never runs code")
    assert capsys.readouterr().out == "" and not marker.exists()  # no prompt (it would be on stdout)
    if model_type == "evil_arch":  # and from a real process, whose stdin is no terminal: nothing on stdout either
        proc = subprocess.run([sys.executable, "-m", "halfsafe.cli", "scan", str(model), *SHORT], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not marker.exists()


def test_the_loader_itself_never_runs_a_folders_code(model, tmp_path, monkeypatch):
    """Behind the refusal: transformers is told trust_remote_code=False, so even on a terminal whose user would
    answer yes it neither asks nor imports."""
    import builtins

    from transformers import AutoConfig

    from halfsafe.io.trust import from_pretrained

    marker, asked = tmp_path / "code-ran", []
    _evil(model, marker)
    (model / "config.json").write_text(json.dumps({"model_type": "evil_arch", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    with pytest.raises(ValueError, match="trust_remote_code"):
        from_pretrained(AutoConfig, model, local_files_only=True)
    assert not asked and not marker.exists()


def test_every_transformers_load_goes_through_the_one_that_refuses_remote_code():
    """No `X.from_pretrained(...)` call anywhere in halfsafe but in io/trust.py (which passes trust_remote_code=False)."""
    src = Path(halfsafe.__file__).parent
    calls = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
                calls.append(f"{path.relative_to(src)}:{node.lineno}")
    assert calls and all(c.startswith("io/trust.py:") for c in calls), calls


# --- MODEL never written, replaced or deleted ----------------------------------------------------------------------


def test_convert_onto_the_model_itself_is_refused(model, capsys):
    (model / "notes.txt").write_text("mine")
    before = folder_hash(model)
    refused(capsys, ["convert", str(model), str(model), "--overwrite", *SHORT], "never writes over or deletes its input")
    assert folder_hash(model) == before


def test_convert_into_a_folder_holding_the_model_is_refused(model, capsys):
    parent = model.parent
    (parent / "thesis.tex").write_text("years of work")
    before = folder_hash(parent)
    refused(capsys, ["convert", str(model), str(parent), "--overwrite", *SHORT], "a folder that holds the model")
    assert folder_hash(parent) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_convert_into_the_model_folder_is_refused(model, capsys, overwrite):
    before = folder_hash(model)
    refused(capsys, ["convert", str(model), str(model / "out"), *overwrite, *SHORT], "inside the model folder")
    assert folder_hash(model) == before

def test_no_output_path_may_write_into_the_model(model, capsys):
    """The reports too: OUT, --json and --plot are kept out of MODEL."""
    before = folder_hash(model)
    refused(capsys, ["scan", str(model), "--json", str(model / "report.json"), *SHORT], "inside the model folder")
    refused(capsys, ["verify", str(model), "--plot", str(model / "kl.png")], "inside the model folder")
    assert folder_hash(model) == before


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    return tiny_plan(-1)


# --- property tests --------------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def plan_edits(plan: dict):
    """A halfsafe plan with some fields replaced by anything JSON can hold, or by a nearby value."""
    fields = sorted(plan)
    nearby = {"exponents": st.dictionaries(st.sampled_from(["residual", "nope"]), st.integers(-600, 600) | JSON, max_size=2),
              "tensors": st.lists(st.fixed_dictionaries({"param": st.sampled_from([t["param"] for t in plan["tensors"]]) | JSON,
                                                         "kind": st.sampled_from(["mul", "gain1p", "x"]),
                                                         "exponent": st.integers(-200, 200) | JSON, "part": st.none() | JSON}),
                                  max_size=3),
              "format": st.integers(-2, 4) | JSON}
    edits = st.dictionaries(st.sampled_from(fields), st.one_of(JSON, *[nearby.get(f, JSON) for f in fields]), max_size=3)
    drops = st.sets(st.sampled_from(fields), max_size=2)
    return st.builds(lambda e, d: {k: v for k, v in {**plan, **e}.items() if k not in d}, edits, drops)


@PROPERTY
@given(data=st.data())
def test_any_plan_dict_is_read_correctly_or_refused_in_one_line(plan_dict, data):
    d = data.draw(plan_edits(plan_dict) | JSON)
    m = make_tiny("llama")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    try:
        plan = Plan.from_dict(d)
    except HalfsafeError as e:
        assert "\n" not in str(e)
        return
    defaults = {"tensors": [], "eps_exponent": 0, "eps_fields": {}, "context_length": None, "format": 1, "halfsafe_version": ""}
    assert plan.to_dict() == {**defaults, **{k: v for k, v in d.items() if k in plan.to_dict()}}
    from halfsafe.convert import apply_plan_

    try:
        apply_plan_(m, plan)
    except HalfsafeError:  # refused before any weight changed
        assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
        return
    rows = plan.tensors
    if not rows and plan.format == 1:  # a format-1 plan may leave its list out: today's family data makes it
        from halfsafe.core.groups import expand
        from halfsafe.core.plan import tensor_table
        from halfsafe.families import family_for

        rows = tensor_table(expand(family_for("llama"), m), plan.exponents)
    moved = {t["param"]: t["exponent"] for t in rows}
    assert all(torch.equal(p, before[n] * 2.0 ** moved.get(n, 0)) for n, p in m.named_parameters())


def test_a_format1_plan_without_its_tensor_list_moves_what_its_groups_move():
    """The case the property above met by chance: no `format` (1) and an empty tensor list, the list left out as
    format 1 allows, so the groups' exponents decide (llama's are all multiplications)."""
    from halfsafe.convert import apply_plan_

    m = make_tiny("llama")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    plan = Plan.from_dict({"family": "llama", "model_type": "llama", "exponents": {"residual": -1}, "headroom_bits": 2.0,
                           "tensors": [], "eps_exponent": -2, "halfsafe_version": "0.1.0"})
    apply_plan_(m, plan)
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert "model.embed_tokens.weight" in changed and all(torch.equal(m.get_parameter(n), before[n] / 2) for n in changed)


def _moved_by(plan: Plan) -> list[dict]:
    """The tensors an applied plan moved: its list, or where a format-1 plan has none (left out or empty), what its
    groups' exponents move in the family's data (test_a_format1_plan_without_its_tensor_list_moves_what_its_groups_move)."""
    if plan.tensors:
        return plan.tensors
    from halfsafe.core.groups import expand
    from halfsafe.core.plan import tensor_table
    from halfsafe.families import family_for

    m = make_tiny(plan.model_type)
    return tensor_table(expand(family_for(plan.model_type), m), plan.exponents)


@settings(PROPERTY, max_examples=5)
@given(data=st.data())
def test_apply_with_any_plan_gives_a_correct_checkpoint_or_one_line(tiny, plan_dict, tmp_path_factory, capsys, data):
    d = data.draw(plan_edits(plan_dict))
    work = tmp_path_factory.mktemp("apply")
    (work / "plan.json").write_text(json.dumps(d))
    before, plan_before = folder_hash(tiny), (work / "plan.json").read_bytes()
    capsys.readouterr()
    code = main(["apply", str(work / "plan.json"), str(tiny), str(work / "out"), *SHORT])
    err = capsys.readouterr().err.strip()
    assert folder_hash(tiny) == before and (work / "plan.json").read_bytes() == plan_before
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        assert len([l for l in err.splitlines() if l.startswith("error:")]) == 1 and not (work / "out").exists(), err
        return
    saved, stored = load_file(work / "out" / "model.safetensors"), load_file(tiny / "model.safetensors")
    moved = {t["param"]: t["exponent"] for t in _moved_by(Plan.from_dict(d))}
    assert all(torch.equal(saved[k], (stored[k].float() * 2.0 ** moved.get(k, 0)).half()) for k in stored if k in saved)


DTYPES = st.sampled_from(["F32", "BF16", "F16", "I64", "BOOL", "F8_E4M3", "X9", ""])


@st.composite
def safetensors_files(draw, keys: list[str]):
    """Bytes of a file that starts like safetensors: a header of tensors (the tiny model's names, hostile names, odd
    dtypes, shapes and offsets) and a body of some length; sometimes a header length that lies."""
    entries = {}
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(keys) | st.sampled_from(["../../etc/passwd", "/abs", "", "__metadata__"]) | st.text(max_size=6))
        shape = draw(st.lists(st.integers(-1, 70) | st.sampled_from([2**40, 2**63 - 1]), max_size=3))
        start = draw(st.integers(0, 64))
        entries[name] = {"dtype": draw(DTYPES), "shape": shape,
                         "data_offsets": draw(st.sampled_from([[start, start + draw(st.integers(-4, 2**20))], [0], "x"]))}
    header = json.dumps(entries).encode() if draw(st.booleans()) else draw(st.binary(max_size=40))
    length = draw(st.sampled_from([len(header), len(header) + 7, 2**40, 0]))
    return struct.pack("<Q", length) + header + draw(st.binary(max_size=64)) + b"\0" * draw(st.integers(0, 4096))


@settings(PROPERTY, max_examples=40)
@given(data=st.data())
def test_any_safetensors_header_gives_a_scan_or_one_line(tiny, tmp_path_factory, capsys, data):
    keys = list(load_file(tiny / "model.safetensors"))
    folder = tmp_path_factory.mktemp("hostile") / "model"
    folder.mkdir()
    (folder / "config.json").write_text((tiny / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(data.draw(safetensors_files(keys)))
    before = folder_hash(folder)
    capsys.readouterr()
    code = main(["scan", str(folder), *SHORT])
    err = capsys.readouterr().err.strip()
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        assert len(err.splitlines()) == 1, err
    assert folder_hash(folder) == before


def test_a_model_given_in_memory_with_a_non_finite_weight_is_named_corrupt():
    """The Python API takes models halfsafe did not load: a NaN there is reported as corruption, not as an
    fp16 overflow or an OverflowError from the solver."""
    from tiny import tiny_ids

    from halfsafe.convert import plan_fp16_safe

    model = make_tiny("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = math.nan
    with pytest.raises(HalfsafeError, match="non-finite even in float32: the model's weights are corrupt"):
        plan_fp16_safe(model, [tiny_ids(model, 16)], progress=False)
