"""`scan --runtime` and `verify --runtime` on a tiny stress model: the quantities the profile holds in float16, and a
converted model that is finite under PyTorch's arithmetic but collapses under float16 norm statistics."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from stress import make_stress
from tiny import make_tiny

from halfsafe.calibration import default_text, heldout_text, make_samples
from halfsafe.convert import make_fp16_safe
from halfsafe.core import arith16
from halfsafe.core.collapse import collapsed
from halfsafe.core.forward import logits
from halfsafe.engine.precision import cast_copy
from halfsafe.runtime.profiles import PROFILES
from halfsafe.runtime.stats import RuntimeCollector
from halfsafe.scan import scan
from halfsafe.verify import FP16, HALFSAFE, verify
from halfsafe.verify.report import Metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stressed():
    """A tiny Gemma 3 text model whose residual passes 65504 (tests/stress.py), its conversion, and calibration."""
    model = make_tiny("gemma3_text")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    conv = copy.deepcopy(model)
    make_fp16_safe(conv, calib, progress=False)
    return model, conv, calib


def test_scan_runtime_norm_statistics_against_numpy(stressed):
    model, _, calib = stressed
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].detach().double().numpy()))
             for n, m in model.named_modules() if type(m).__name__ == "Gemma3RMSNorm"]
    with RuntimeCollector(model, PROFILES["fp16-norm-stats"]) as c, torch.no_grad():
        for ids in calib:
            model(input_ids=ids)
    for h in hooks:
        h.remove()
    assert set(c.scan.norms) == set(seen) and not c.scan.linears  # no matmul accumulation in this profile
    over = 0
    for name, xs in seen.items():
        rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in xs])
        sums = (rows ** 2).sum(-1)
        s = c.scan.norms[name]
        assert s.abs_max == pytest.approx(np.abs(rows).max(), rel=1e-6)
        assert s.sum_sq_max == pytest.approx(sums.max(), rel=1e-5)
        assert s.mean_sq_max == pytest.approx(sums.max() / rows.shape[1], rel=1e-5)
        assert s.rows == rows.shape[0] and s.rows_sum_overflow == int((sums > 65504).sum())
        over += s.rows_sum_overflow
    assert over > 0 and not c.scan.fits


def test_scan_runtime_linear_partial_sums_against_a_loop(stressed):
    model, _, calib = stressed
    name = "model.layers.0.mlp.down_proj"
    lin = dict(model.named_modules())[name]
    xs = []
    h = lin.register_forward_pre_hook(lambda mod, args: xs.append(args[0].detach().reshape(-1, args[0].shape[-1]).double()))
    with RuntimeCollector(model, PROFILES["fp16-accumulate"]) as c, torch.no_grad():
        model(input_ids=calib[0])
    h.remove()
    x, w = xs[0], lin.weight.detach().double()
    best = 0.0
    for start in range(0, x.shape[1], 32):  # running sum after each run of 32 products
        partial = x[:, : start + 32] @ w[:, : start + 32].T
        best = max(best, float(partial.abs().max()))
    assert c.scan.linears[name].partial_max == pytest.approx(best, rel=1e-5)
    assert not c.scan.norms


def test_scan_report_carries_the_runtime_and_torch_adds_nothing(stressed):
    model, conv, calib = stressed
    assert scan(model, calib, progress=False).runtime is None
    assert "runtime" not in scan(model, calib, progress=False, runtime="torch").to_dict()
    after = scan(conv, calib, progress=False, runtime="fp16-norm-stats")
    data = after.to_dict()["runtime"]
    assert data["profile"]["name"] == "fp16-norm-stats" and data["norms"]
    assert after.fp16_safe and not after.runtime.fits  # fine for PyTorch, not for float16 statistics


def test_collapse_metrics_by_hand():
    from halfsafe.verify.accumulator import Accumulator

    vocab = 50
    ref = torch.randn(1, 6, vocab) * 4
    acc = Accumulator(lm=False, collapse=True)
    uniform = torch.zeros(1, 6, vocab)  # finite, every row uniform: argmax 0 everywhere
    acc.add(ref, uniform, None, False)
    m = acc.metrics()
    assert m.nonfinite_logits == 0 and m.uniform_positions == 6 and m.mode_fraction == 1.0
    assert m.entropy_mean == pytest.approx(math.log(vocab), rel=1e-6) and m.collapsed
    acc2 = Accumulator(lm=False, collapse=True)
    acc2.add(ref, ref.clone(), None, False)
    assert acc2.metrics().collapsed is False and acc2.metrics().uniform_positions == 0
    assert "collapsed" not in Metrics().to_dict() and Accumulator(lm=False).metrics().collapsed is None
    assert collapsed(ref, uniform) and not collapsed(ref, ref.clone())  # convert --runtime's judgement, the same


def test_verify_runtime_shows_the_silent_collapse(stressed):
    model, conv, _ = stressed
    half = cast_copy(conv, torch.float16).eval()
    report = verify(model, half, texts=[heldout_text()[:400]], seq_len=48, max_samples=1, greedy_tokens=0,
                    variants=[FP16, HALFSAFE], runtime="fp16-norm-stats")
    names = [r.name for r in report.results]
    assert names == ["fp32", FP16, f"{FP16} @ fp16-norm-stats", HALFSAFE, f"{HALFSAFE} @ fp16-norm-stats"]
    plain, under = report.result(HALFSAFE).overall, report.result(f"{HALFSAFE} @ fp16-norm-stats").overall
    assert plain.nonfinite_logits == 0 and not plain.collapsed
    assert under.collapsed or under.nonfinite_logits > 0
    assert report.to_dict()["runtime"]["name"] == "fp16-norm-stats"
    assert "runtime" not in verify(model, half, texts=[heldout_text()[:200]], seq_len=24, max_samples=1, greedy_tokens=0,
                                   variants=[HALFSAFE]).to_dict()


def test_float16_rounding_of_the_statistics_is_visible():
    assert arith16.r16(torch.tensor(65519.0)).item() == 65504.0 and math.isinf(arith16.r16(torch.tensor(65520.0)).item())


def test_cli_scan_and_verify_with_a_runtime(stressed, tmp_path, capsys):
    import json

    from halfsafe.cli import main

    model, _, _ = stressed
    model.save_pretrained(tmp_path / "m")
    args = ["--seq-len", "24", "--max-samples", "1"]
    assert main(["scan", str(tmp_path / "m"), *args, "--runtime", "fp16-norm-stats", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "Runtime fp16-norm-stats" in out and "does not fit" in out
    assert json.loads((tmp_path / "s.json").read_text())["runtime"]["fits"] is False
    assert main(["verify", str(tmp_path / "m"), *args, "--greedy-tokens", "0", "--runtime", "fp16-accumulate",
                 "--json", str(tmp_path / "v.json")]) == 0
    names = [v["name"] for v in json.loads((tmp_path / "v.json").read_text())["variants"]]
    assert "fp16 @ fp16-accumulate" in names and "Finite but broken?" in capsys.readouterr().out


def test_verify_runs_a_profile_variant_alone(stressed):
    model, conv, _ = stressed
    half = cast_copy(conv, torch.float16).eval()
    report = verify(model, half, texts=[heldout_text()[:200]], seq_len=24, max_samples=1, greedy_tokens=0,
                    variants=[f"{HALFSAFE} @ fp16-accumulate"], runtime="fp16-accumulate")
    assert [r.name for r in report.results] == ["fp32", f"{HALFSAFE} @ fp16-accumulate"]
