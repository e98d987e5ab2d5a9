"""What halfsafe promises about its input, held against hostile folders built here: nothing is read from outside
MODEL and nothing it ships is run; MODEL is never written, replaced or deleted, and --overwrite replaces only a
folder halfsafe wrote (or an empty one), never one that appeared meanwhile; a corrupt or inconsistent input, a bad
option or a bad plan is refused in one line (exit 2) before the slow part; a plan that would zero a model is never
applied. Property tests (hypothesis) over plan dicts and safetensors headers: any input gives a correct result or
a one-line error with exit 2, never a traceback, never a changed input folder."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

import halfsafe
from halfsafe.cli import main
from halfsafe.errors import HalfsafeError
from halfsafe.families import family_for
from halfsafe.groups import expand
from halfsafe.plan import Plan
from tiny import make_tiny, save_tiny

SHORT = ["--seq-len", "32", "--max-samples", "1"]
PROPERTY = settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])


def folder_hash(folder: Path) -> str:
    """Every entry under `folder`: its path, its link target or its bytes."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_symlink():
            h.update(b"-> " + os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def refused(capsys, argv: list[str], *says: str) -> str:
    """`halfsafe ARGV` exits 2 with one line on stderr (no traceback) that says each of `says`."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def model(tiny, tmp_path) -> Path:
    """A fresh copy of the tiny checkpoint, to be made hostile."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


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

    from halfsafe.trust import from_pretrained

    marker, asked = tmp_path / "code-ran", []
    _evil(model, marker)
    (model / "config.json").write_text(json.dumps({"model_type": "evil_arch", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    with pytest.raises(ValueError, match="trust_remote_code"):
        from_pretrained(AutoConfig, model, local_files_only=True)
    assert not asked and not marker.exists()


def test_every_transformers_load_goes_through_the_one_that_refuses_remote_code():
    """No `X.from_pretrained(...)` call anywhere in halfsafe but in trust.py (which passes trust_remote_code=False)."""
    src = Path(halfsafe.__file__).parent
    calls = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
                calls.append(f"{path.relative_to(src)}:{node.lineno}")
    assert calls and all(c.startswith("trust.py:") for c in calls), calls


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


def test_overwrite_replaces_only_a_folder_halfsafe_wrote_or_an_empty_one(model, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "photo.jpg").write_bytes(b"\xff\xd8")
    refused(capsys, ["convert", str(model), str(mine), "--overwrite", *SHORT], "did not write", "halfsafe.json")
    assert (mine / "photo.jpg").read_bytes() == b"\xff\xd8"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(model), str(empty), "--overwrite", *SHORT]) == 0  # an empty folder
    assert main(["convert", str(model), str(empty), "--overwrite", *SHORT]) == 0  # a folder halfsafe wrote
    assert (empty / "halfsafe.json").is_file() and not list(tmp_path.glob(".empty.*"))


def _convert_while_paused(model: Path, out: Path, meanwhile, mine: list[str], monkeypatch) -> tuple[int, str]:
    """This run converts MODEL into OUT; right after its save-time checks (while it writes) `meanwhile()` puts another
    folder at OUT. Returns this run's exit code and the hash of that folder."""
    import halfsafe.checkpoint as checkpoint

    real, seen = checkpoint._write_extras, {}

    def write_extras(*args, **kwargs):
        meanwhile()
        seen["other"] = folder_hash(out)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_write_extras", write_extras)
    return main(["convert", str(model), str(out), *SHORT, *mine]), seen["other"]


def test_two_converts_to_one_out_the_second_to_finish_fails_and_the_first_stays(model, tmp_path, capsys, monkeypatch):
    """Two real processes: the other one finishes while this one writes (its clean-up must spare this one's
    temporary folder, and this one's rename must not replace its output)."""
    out = tmp_path / "out"

    def other_run():
        done = subprocess.run([sys.executable, "-m", "halfsafe.cli", "convert", str(model), str(out), *SHORT],
                              capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        assert done.returncode == 0, done.stderr

    capsys.readouterr()
    code, other = _convert_while_paused(model, out, other_run, [], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "appeared while this run was writing it" in err[0], err
    assert folder_hash(out) == other and (out / "halfsafe.json").is_file()  # the first to finish: intact
    assert not list(tmp_path.glob(".out.*"))


def test_overwrite_replaces_only_the_folder_that_was_there_when_the_save_began(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["convert", str(model), str(out), *SHORT]) == 0
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "halfsafe.json").write_text("{}")

    def replaced_meanwhile():  # as another --overwrite run's swap would: the old folder out, a new one in
        out.rename(tmp_path / "older")
        newer.rename(out)

    capsys.readouterr()
    code, other = _convert_while_paused(model, out, replaced_meanwhile, ["--overwrite"], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "appeared while this run was writing it" in err[0], err
    assert folder_hash(out) == other and not list(tmp_path.glob(".out.*"))


def test_no_output_path_may_write_into_the_model(model, capsys):
    """The reports too: OUT, --json and --plot are kept out of MODEL."""
    before = folder_hash(model)
    refused(capsys, ["scan", str(model), "--json", str(model / "report.json"), *SHORT], "inside the model folder")
    refused(capsys, ["verify", str(model), "--plot", str(model / "kl.png")], "inside the model folder")
    assert folder_hash(model) == before


# --- corrupt or inconsistent input: one line, before the slow part --------------------------------------------------


@pytest.fixture
def no_slow_part(monkeypatch):
    monkeypatch.setattr("halfsafe.convert.make_fp16_safe", lambda *a, **k: pytest.fail("the slow part ran"))
    monkeypatch.setattr(sys.modules["halfsafe.scan"], "scan", lambda *a, **k: pytest.fail("the slow part ran"))
    monkeypatch.setattr("halfsafe.convert.scan", lambda *a, **k: pytest.fail("the slow part ran"))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_weight_is_a_corrupt_checkpoint(model, tmp_path, capsys, no_slow_part, value):
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    for argv in (["convert", str(model), str(tmp_path / "out")], ["scan", str(model)], ["convert", str(model), str(tmp_path / "o"), "--whole"]):
        refused(capsys, [*argv, *SHORT], "non-finite weights in model.layers.1.mlp.up_proj.weight", "the checkpoint is corrupt")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, says", [
    ("num_hidden_layers", 100000, "num_hidden_layers 100000, but the checkpoint stores layers up to 1"),
    ("hidden_size", 10**7, "hidden_size 10000000, a size no weight"),
    ("vocab_size", 10**9, "vocab_size 1000000000"),
    ("intermediate_size", 10**7, "mlp.gate_proj.weight is [10000000, 64], but the checkpoint stores [128, 64]"),
    ("num_attention_heads", 64, "self_attn"),
])
def test_a_config_that_disagrees_with_the_weights_is_refused_fast(model, capsys, no_slow_part, field, value, says):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, field: value}))
    for extra in ([], ["--whole"]):
        start = time.perf_counter()
        refused(capsys, ["scan", str(model), *extra, *SHORT], "does not match the weights", says)
        assert time.perf_counter() - start < 10


def test_a_shard_larger_than_this_machine_can_map_is_refused(model, capsys):
    from halfsafe.validate import mappable_bytes

    limit = mappable_bytes()
    if limit is None:
        pytest.skip("this machine maps files of any size (overcommit without limit)")
    n = limit // 2 + (1 << 30)  # bf16 elements: 2 GB more than can be mapped, stored sparse (no disk used)
    header = json.dumps({"huge": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(model / "model-huge.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * n)
    refused(capsys, ["scan", str(model), *SHORT], "model-huge.safetensors", "more than this machine can map")


def test_every_option_is_parsed_before_anything_loads(model, tmp_path, capsys, no_slow_part):
    out = str(tmp_path / "out")
    refused(capsys, ["convert", str(model), out, "--max-shard-size", "banana"], "argument --max-shard-size", "'banana' is not a size")
    refused(capsys, ["convert", str(model), out, "--seq-len", "-3"], "argument --seq-len")
    refused(capsys, ["convert", str(model), out, "--headroom-bits", "nan"], "--headroom-bits", "not a finite number")
    refused(capsys, ["scan", str(model), "--device", "tpu"], "unknown device 'tpu'")
    refused(capsys, ["convert", str(model)], "out")  # a missing argument: one line too
    assert not Path(out).exists()


def test_a_valid_shard_size_reaches_the_writer(model, tmp_path):
    assert main(["convert", str(model), str(tmp_path / "out"), "--max-shard-size", "100KB", *SHORT]) == 0
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1


# --- plans: validated in one place; none that zeroes a model is applied -------------------------------------------


@pytest.fixture(scope="module")
def plan_dict(tiny) -> dict:
    """A valid plan for the tiny model (residual x 2^-1), as plan.json holds it."""
    m = make_tiny("llama")
    family = family_for("llama")
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    return Plan.build(family.name, "llama", expand(family, m), {"residual": -1}, 2.0, None, shapes).to_dict()


def _consistent(plan: dict, residual: int) -> dict:
    """The plan with another residual exponent and the tensor list that goes with it (as if halfsafe had written it)."""
    m = make_tiny("llama")
    family = family_for("llama")
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    return {**Plan.build(family.name, "llama", expand(family, m), {"residual": residual}, 2.0, None, shapes).to_dict(),
            "halfsafe_version": plan["halfsafe_version"]}


def _hostile(plan: dict, case: str):
    if case.startswith("residual "):
        return {**plan, "exponents": {"residual": json.loads(case.split()[1])}}
    return {
        "format abc": {**plan, "format": "abc"},
        "plan null": {"plan": None},
        "tensors as strings": {**plan, "tensors": [t["param"] for t in plan["tensors"]]},
        "empty tensor list": {**plan, "tensors": []},
        "a list": [plan],
        "a group name with a newline": {**plan, "exponents": {"no\nsuch": -1}},
    }[case]


@pytest.mark.parametrize("case, says", [
    ("residual -60", "integers from -24 to 24"), ("residual -500", "integers from -24 to 24"),
    ("residual 500", "integers from -24 to 24"), ("residual 0.5", "is 0.5"), ("residual 1e999", "is inf"),
    ("format abc", "format is 'abc'"), ("plan null", "the plan is null"), ("tensors as strings", "tensor 0 is a string"),
    ("empty tensor list", "differs from what today's"), ("a list", "the plan is a list"),
    ("a group name with a newline", "names groups this model does not have: no such"),
])
def test_a_bad_plan_is_refused_in_one_line_before_anything_is_written(model, plan_dict, tmp_path, capsys, case, says):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_hostile(plan_dict, case)) if case != "residual -60" else
                    json.dumps(_consistent(plan_dict, -60)))  # -60 with the tensor list that goes with it
    before = folder_hash(model)
    refused(capsys, ["apply", str(plan), str(model), str(tmp_path / "out"), *SHORT], says)
    assert folder_hash(model) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("residual, says", [(-24, "flushes model.embed_tokens.weight to zero"), (24, "exceed 65504")])
def test_a_plan_that_would_zero_or_overflow_a_tensor_in_fp16_is_refused(model, plan_dict, tmp_path, capsys, residual, says):
    """Within the solver's range, yet ruinous for these weights (the tiny model's are ~0.02: x 2^-24 is below fp16's
    smallest subnormal, x 2^24 above 65504): the storage check refuses before writing."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_consistent(plan_dict, residual)))
    refused(capsys, ["apply", str(plan), str(model), str(tmp_path / "out"), *SHORT], says, "nothing was written")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_good_plan_applies(model, plan_dict, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_dict))
    assert main(["apply", str(plan), str(model), str(tmp_path / "out"), *SHORT]) == 0
    assert "fp16-safe on the check text" in capsys.readouterr().out


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
    moved = {t["param"]: t["exponent"] for t in plan.tensors}
    assert all(torch.equal(p, before[n] * 2.0 ** moved.get(n, 0)) for n, p in m.named_parameters())


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
    moved = {t["param"]: t["exponent"] for t in d["tensors"]}
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
