"""`halfsafe apply PLAN MODEL OUT`: a saved, versioned plan re-applied to another checkpoint of the same
architecture, refused with one line when it does not fit, and followed by a scan that says whether the new
weights still fit fp16."""

from __future__ import annotations

import json

import pytest
import torch
from hostile import SHORT, copy_of, folder_hash, refused, tiny_plan
from safetensors.torch import load_file
from stress import make_stress
from tiny import make_tiny, save_tiny
from transformers import AutoModelForCausalLM

from halfsafe.calibration import default_text, make_samples
from halfsafe.cli import main
from halfsafe.core.forward import logits
from halfsafe.core.plan import PLAN_FORMAT, Plan

ARGS = ["--seq-len", "32", "--max-samples", "2"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("apply")
    calib = make_samples([default_text()], None, 256, 32, 2)
    model = make_tiny("llama")
    k = make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.save_pretrained(root / "base")
    assert main(["convert", str(root / "base"), str(root / "out"), *ARGS]) == 0
    return root, model, k


def _fine_tune(model, seed: int, scale: float = 1e-3):
    """The same architecture with every weight nudged, as a short fine-tune would."""
    g = torch.Generator().manual_seed(seed)
    ft = type(model)(model.config)
    ft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return ft.eval()


def test_plan_file_is_versioned_and_self_describing(converted):
    root, _, _ = converted
    plan = json.loads((root / "out" / "halfsafe.json").read_text())["plan"]
    assert plan["format"] == PLAN_FORMAT and plan["halfsafe_version"]
    assert plan["tensors"] and all({"param", "kind", "exponent", "part", "shape"} <= set(t) for t in plan["tensors"])


def test_apply_to_a_fine_tune_rescales_exactly_and_reports_fp16_safe(converted, tmp_path, capsys):
    root, model, _ = converted
    ft = _fine_tune(model, seed=1)
    ft.save_pretrained(tmp_path / "ft")
    assert main(["apply", str(root / "out"), str(tmp_path / "ft"), str(tmp_path / "ft-fp16"), *ARGS]) == 0
    assert "fp16-safe" in capsys.readouterr().out
    info = json.loads((tmp_path / "ft-fp16" / "halfsafe.json").read_text())
    assert info["scan_after"]["fp16_safe"] is True and info["scan_after"]["first_nonfinite_fp16"] is None
    saved = load_file(tmp_path / "ft-fp16" / "model.safetensors")
    params = dict(ft.named_parameters())
    for t in info["plan"]["tensors"]:  # every listed tensor: the fine-tune's value x 2^exponent, stored in fp16
        assert torch.equal(saved[t["param"]], (params[t["param"]].detach() * 2.0 ** t["exponent"]).half()), t["param"]
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "ft-fp16", dtype=torch.float16)
    ids = make_samples([default_text()], None, 256, 32, 1)[0]
    assert torch.isfinite(half(input_ids=ids).logits).all()


@pytest.mark.parametrize("growth, code, says", [(64, 0, "does NOT keep the plan's"), (4096, 2, "not fp16-safe")])
def test_a_fine_tune_whose_activations_grew_is_reported(converted, tmp_path, capsys, growth, code, says):
    """64x larger residual writes still fit (measured peak 4.5e4) but eat the margin: saved, and said; 4096x overflow:
    refused in one line, nothing saved (halfsafe never writes a result its own scan finds not fp16-safe)."""
    root, model, _ = converted
    grown = _fine_tune(model, seed=2)
    with torch.no_grad():
        for layer in grown.model.layers:
            layer.mlp.down_proj.weight.mul_(growth)
    grown.save_pretrained(tmp_path / "grown")
    capsys.readouterr()
    assert main(["apply", str(root / "out"), str(tmp_path / "grown"), str(tmp_path / "grown-fp16"), *ARGS]) == code
    out, err = capsys.readouterr()
    if code == 0:
        assert says in out and (tmp_path / "grown-fp16" / "halfsafe.json").is_file()
    else:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0] and "fp16-safe on" not in out, err
        assert not (tmp_path / "grown-fp16").exists() and not list(tmp_path.glob(".grown-fp16*"))


@pytest.mark.parametrize("case", ["other size", "newer format", "edited tensor list", "not a plan"])
def test_a_plan_that_does_not_fit_is_refused_with_one_line(converted, tmp_path, capsys, case):
    root, model, _ = converted
    target, plan_path = tmp_path / "target", tmp_path / "plan.json"
    info = json.loads((root / "out" / "halfsafe.json").read_text())
    plan = info["plan"]
    if case == "other size":
        config = model.config.__class__.from_dict({**model.config.to_dict(), "intermediate_size": 96})
        type(model)(config).save_pretrained(target)
    else:
        model.save_pretrained(target)
    if case == "newer format":
        plan["format"] = PLAN_FORMAT + 1
    if case == "edited tensor list":
        plan["tensors"][0]["exponent"] += 1
    plan_path.write_text(json.dumps({"plan": plan} if case != "not a plan" else {"hello": 1}))
    assert main(["apply", str(plan_path), str(target), str(tmp_path / "out"), *ARGS]) == 2
    err = capsys.readouterr().err
    expected = {"other size": "another size", "newer format": "upgrade halfsafe", "edited tensor list": "differs from",
                "not a plan": "not a halfsafe plan"}[case]
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (the rest: this test's own saving)
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_plan_from_the_first_format_still_loads(converted, tmp_path):
    root, _, _ = converted
    plan = json.loads((root / "out" / "halfsafe.json").read_text())["plan"]
    for key in ("format", "halfsafe_version"):
        plan.pop(key)
    for t in plan["tensors"]:
        t.pop("shape")
    (tmp_path / "old.json").write_text(json.dumps(plan))
    old = Plan.load(tmp_path / "old.json")
    assert old.format == 1 and old.exponents == {k: v for k, v in plan["exponents"].items()}


# --- hostile plans: refused in one line by the schema (plan_schema.py) or the storage check, nothing written -------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def model(tiny, tmp_path):
    return copy_of(tiny, tmp_path / "model")


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    return tiny_plan(-1)


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
                    json.dumps(tiny_plan(-60)))  # -60 with the tensor list that goes with it
    before = folder_hash(model)
    refused(capsys, ["apply", str(plan), str(model), str(tmp_path / "out"), *SHORT], says)
    assert folder_hash(model) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("residual, says", [(-24, "flushes model.embed_tokens.weight to zero"), (24, "exceed 65504")])
def test_a_plan_that_would_zero_or_overflow_a_tensor_in_fp16_is_refused(model, plan_dict, tmp_path, capsys, residual, says):
    """Within the solver's range, yet ruinous for these weights (the tiny model's are ~0.02: x 2^-24 is below fp16's
    smallest subnormal, x 2^24 above 65504): the storage check refuses before writing."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(tiny_plan(residual)))
    refused(capsys, ["apply", str(plan), str(model), str(tmp_path / "out"), *SHORT], says, "nothing was written")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_good_plan_applies(model, plan_dict, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_dict))
    assert main(["apply", str(plan), str(model), str(tmp_path / "out"), *SHORT]) == 0
    assert "fp16-safe on the check text" in capsys.readouterr().out
