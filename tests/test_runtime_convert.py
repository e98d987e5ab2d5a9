"""`convert --runtime P` on a tiny stress model: chosen under the profile where the checkpoint can hold it, a one-line
refusal (exit 2, nothing written) where it cannot, and `--runtime torch` byte-identical to no option."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from stress import make_stress
from tiny import make_tiny

from halfsafe.calibration import default_text, make_samples
from halfsafe.cli import main
from halfsafe.convert import make_fp16_safe
from halfsafe.core.forward import logits
from halfsafe.engine.precision import cast_copy
from halfsafe.errors import HalfsafeError
from halfsafe.runtime.emulate import emulate_runtime
from halfsafe.runtime.profiles import PROFILES

pytestmark = pytest.mark.usefixtures("one_thread")
ARGS = ["--seq-len", "32", "--max-samples", "2"]


@pytest.fixture(scope="module")
def stressed():
    model = make_tiny("gemma3_text")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    return model, calib


def test_fp16_accumulate_is_chosen_under_the_profile(stressed):
    model, calib = stressed
    conv = copy.deepcopy(model)
    report = make_fp16_safe(conv, calib, progress=False, runtime="fp16-accumulate")
    info = report.to_dict()["runtime"]
    assert info["profile"]["name"] == "fp16-accumulate"
    assert {k: v for k, v in info["chosen"].items() if v} == report.plan.exponents
    chosen = next(c for c in info["candidates"] if c["exponents"] == info["chosen"])
    assert chosen["finite"] and not chosen["collapsed"] and chosen["kl"] <= info["bf16_kl"]
    assert all(c["kl"] >= chosen["kl"] for c in info["candidates"] if c["finite"] and not c["collapsed"]
               and c["kl"] <= info["bf16_kl"] and not c["overflowing_weights"])
    half = cast_copy(conv, torch.float16).eval()  # the written weights, run under the profile: finite
    with emulate_runtime(half, PROFILES["fp16-accumulate"]), torch.no_grad():
        assert torch.isfinite(logits(half, calib[1])).all()


def test_fp16_norm_stats_refuses_in_one_line(stressed):
    model, calib = stressed
    conv = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in conv.named_parameters()}
    with pytest.raises(HalfsafeError) as e:
        make_fp16_safe(conv, calib, progress=False, runtime="fp16-norm-stats")
    msg = str(e.value)
    assert "\n" not in msg and "--runtime fp16-norm-stats" in msg and "sum of squares" in msg and "2^" in msg, msg
    assert all(torch.equal(p, before[n]) for n, p in conv.named_parameters())  # refused before any weight changed


def test_cli_refusal_exit_2_writes_nothing_and_torch_is_byte_identical(stressed, tmp_path, capsys):
    model, _ = stressed
    model.save_pretrained(tmp_path / "base")
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "refused"), *ARGS, "--runtime", "fp16-norm-stats"]) == 2
    err = capsys.readouterr().err
    assert "no fp16 checkpoint runs under --runtime fp16-norm-stats" in err and "Traceback" not in err
    assert not (tmp_path / "refused").exists()
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "plain"), *ARGS]) == 0
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "torch"), *ARGS, "--runtime", "torch"]) == 0
    for f in ("model.safetensors", "halfsafe.json", "config.json"):
        assert (tmp_path / "plain" / f).read_bytes() == (tmp_path / "torch" / f).read_bytes(), f
    assert "runtime" not in json.loads((tmp_path / "torch" / "halfsafe.json").read_text())
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "x"), "--runtime", "webgpu"]) == 2
    assert "invalid choice: 'webgpu'" in capsys.readouterr().err
