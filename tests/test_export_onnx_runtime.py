"""`halfsafe export onnx --runtime P`: norms prescaled inside the graph, checked with the norm statistics in float16.

A tiny Gemma 3 blown past fp16's range (tests/stress.py), converted at default settings (the torch profile's
checkpoint), exported plainly and with `--runtime all-fp16`. Both graphs are run by onnx's reference evaluator
under the all-fp16 profile's arithmetic (float16 ops in float16, matmul sums in float16 runs of 32, float16
reductions and softmax: export.onnx_profile_ops) after `fp16_statistics` made the graph's own float32 casts float16: the plain graph's sums
of squares overflow and zero or NaN its rows; the prescaled one stays finite and close to fp32 transformers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
from stress import make_stress  # noqa: E402
from tiny import make_tiny  # noqa: E402

from halfsafe.calibration import default_text, make_samples  # noqa: E402
from halfsafe.cli import main  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.forward import logits  # noqa: E402
from halfsafe.core.metrics import mean_kl  # noqa: E402
from halfsafe.export import onnx_norms  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.export.onnx_norms import choose_shift, fp16_statistics  # noqa: E402
from halfsafe.export.onnx_runners import OnnxDecoder  # noqa: E402
from halfsafe.runtime.profiles import PROFILES  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("norms")
    model = make_tiny("gemma3_text")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.to(torch.bfloat16).save_pretrained(root / "original")
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    plain = export_onnx(root / "converted", root / "plain")
    for runtime in ("all-fp16", "torch"):  # from the command line, as a user would (three exports: ~30 s in all)
        assert main(["export", "onnx", str(root / "converted"), str(root / runtime), "--runtime", runtime,
                     "--json", str(root / f"{runtime}.json")]) == 0
    profiled = json.loads((root / "all-fp16.json").read_text())
    return root, model.float().eval(), calib, plain, profiled


def _fp16_run(folder, ids) -> np.ndarray:
    proto = fp16_statistics(onnx.load(str(folder / ONNX_FILE)))
    return OnnxDecoder(proto, backend="reference", profile=PROFILES["all-fp16"]).logits(ids.numpy()).astype(np.float32)


def test_fp16_statistics_makes_the_norms_float16(exported):
    root, *_ = exported
    proto = onnx.load(str(root / "plain" / ONNX_FILE))
    to32 = [n for n in proto.graph.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT]
    assert len(to32) > 1  # the modeling code's float32 islands (Gemma's RMSNorm) and the float32 logits
    half = fp16_statistics(proto)
    left = [n for n in half.graph.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT]
    assert [n.output[0] for n in left] == ["logits"]
    assert all(t.data_type != onnx.TensorProto.FLOAT for t in half.graph.initializer)


def test_prescaled_norms_stay_finite_where_plain_ones_break(exported):
    root, fp32, calib, plain, profiled = exported
    ids = calib[1]
    want = logits(fp32, ids).float()
    broken = torch.from_numpy(_fp16_run(root / "plain", ids))
    zeroed = (broken.std(-1) < 1e-3).float().mean()  # rows a zero norm output left uniform
    assert not torch.isfinite(broken).all() or zeroed > 0.5, f"plain export survived fp16 statistics ({zeroed:.0%} uniform)"
    got = torch.from_numpy(_fp16_run(root / "all-fp16", ids))
    assert torch.isfinite(got).all()
    kl = mean_kl(want, got)
    assert kl < 1e-3, kl
    assert profiled["runtime"] == "all-fp16" and profiled["norm_prescales"] and profiled["head_groups"] == 2  # K = 64
    residual = [p for n, p in profiled["norm_prescales"].items() if n.endswith(("input_layernorm", "pre_feedforward_layernorm", "model.norm"))]
    assert any(p["shift"] > 0 for p in residual), profiled["norm_prescales"]  # the residual stream's norms


def test_gemma_gain_is_stored_as_one_plus_w(exported):
    """The Mul after each norm's inverse root and x c takes one stored gain, (1 + w) of the checkpoint's w."""
    from safetensors.torch import load_file

    root, *_ = exported
    proto = onnx.load(str(root / "all-fp16" / ONNX_FILE))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    consumers = {i: n for n in proto.graph.node for i in n.input}
    w = load_file(str(root / "converted" / "model.safetensors"))["model.layers.0.input_layernorm.weight"].float().numpy()
    root_node = next(n for n in proto.graph.node if n.op_type in ("Reciprocal", "Rsqrt"))  # the first norm's
    scaled = consumers[root_node.output[0]]  # (x c) * rsqrt(...)
    gain = consumers[scaled.output[0]]
    stored = [inits[i] for i in gain.input if i in inits]
    assert gain.op_type == "Mul" and len(stored) == 1
    assert np.array_equal(stored[0].astype(np.float32), 1 + w)


def test_torch_runtime_is_todays_export(exported):
    root, *_, plain, _ = exported
    assert (root / "torch" / ONNX_FILE).read_bytes() == (root / "plain" / ONNX_FILE).read_bytes()
    assert plain.norm_prescales == {} and json.loads((root / "torch.json").read_text())["norm_prescales"] == {}


def test_prescaled_graph_computes_the_same_function_with_float32_statistics(exported):
    """With the graph's own float32 casts kept (ONNX Runtime's fp16 graph as exported), the prescale changes nothing
    but rounding: exact powers of two in and out of each norm."""
    root, _, calib, *_ = exported
    ids = calib[0].numpy()
    a = OnnxDecoder(root / "plain" / ONNX_FILE).logits(ids)
    b = OnnxDecoder(root / "all-fp16" / ONNX_FILE).logits(ids)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(a).max()


def test_choose_shift_keeps_the_sum_of_squares_in_range():
    for peak, width in ((3e3, 640), (1.0, 64), (1e-3, 256), (6e4, 4096)):
        k = choose_shift(peak, width)
        assert width * (peak * 2.0 ** -k) ** 2 <= onnx_norms.SUM_LIMIT
        assert k == onnx_norms.SHIFT_RANGE[0] or width * (peak * 2.0 ** -(k - 1)) ** 2 > onnx_norms.SUM_LIMIT  # least k
    assert choose_shift(0.0, 64) == 0


def test_cli_unknown_runtime_exit_2(exported, tmp_path, capsys):
    root, *_ = exported
    assert main(["export", "onnx", str(root / "converted"), str(tmp_path / "x"), "--runtime", "webgpu"]) == 2
    assert "invalid choice: 'webgpu'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_layernorm_family_prescaled_under_the_layernorm_profile(tmp_path):
    """GPT-NeoX (nn.LayerNorm), stressed and converted: under `layernorm-decomposed` each LayerNorm gets its c, and the
    graph with every op in float16 stays finite and close to fp32."""
    model = make_tiny("gpt_neox")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.to(torch.bfloat16).save_pretrained(tmp_path / "original")
    convert_checkpoint(str(tmp_path / "original"), str(tmp_path / "converted"), seq_len=32, max_samples=2, progress=False)
    report = export_onnx(tmp_path / "converted", tmp_path / "onnx", runtime="layernorm-decomposed")
    norms = {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    assert report.norm_prescales and set(report.norm_prescales) <= norms
    assert any(p["shift"] > 0 for p in report.norm_prescales.values())
    got = torch.from_numpy(_fp16_run(tmp_path / "onnx", calib[1]))
    assert torch.isfinite(got).all()
    assert mean_kl(logits(model.float().eval(), calib[1]).float(), got) < 1e-3


def test_convert_to_onnx_under_a_profile_leaves_the_norms_to_the_graph(exported, capsys):
    """`convert --to onnx --runtime all-fp16`: the checkpoint is chosen under the profile's arithmetic without its
    norm statistics (the graph prescales the norms), so where `convert --runtime all-fp16` alone would have to move the
    whole residual stream for the sums of squares, this writes a checkpoint and a graph that runs all-fp16."""
    root, fp32, calib, _, _ = exported
    out = root / "both"
    assert main(["convert", str(root / "original"), str(out), "--seq-len", "32", "--max-samples", "2", "--to", "onnx",
                 "--runtime", "all-fp16"]) == 0
    assert "norms prescaled" in capsys.readouterr().out
    info = json.loads((out / "halfsafe.json").read_text())
    assert info["runtime"]["profile"]["name"] == "all-fp16 (norms in the graph)", info["runtime"]["profile"]
    assert not info["runtime"]["profile"]["rms_stats_fp16"] and info["runtime"]["profile"]["matmul_chunk"] == 32
    ids = calib[1]
    got = torch.from_numpy(_fp16_run(out, ids))
    assert torch.isfinite(got).all()
    assert mean_kl(logits(fp32, ids).float(), got) < 1e-3
