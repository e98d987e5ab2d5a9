"""`halfsafe export onnx --runtime ort-webgpu`: every matrix product's K split into groups added pairwise
(halfsafe.export.onnx_split_k), for ONNX Runtime's WebGPU provider, whose float16 MatMul keeps one float16 running sum.

A tiny Gemma 3 blown past fp16's range (tests/stress.py), converted, exported plainly and under the profile. The
rewrite must compute the same function: the graphs made float32 (every float16 weight, cast and value) agree to
float32 rounding on ONNX Runtime's CPU provider. The split graph runs in transformers.js on the CPU provider as the
plain one does. On the real WebGPU provider (Mesa's lavapipe, scripts/install-webgpu; skipped without it) a wider
tiny model's logits are closer to fp32 with the split than without.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import jsclient  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import webgpu  # noqa: E402
from jsclient import save_char_tokenizer  # noqa: E402
from stress import make_stress  # noqa: E402
from tiny import make_tiny  # noqa: E402

from halfsafe.calibration import default_text, make_samples  # noqa: E402
from halfsafe.cli import main  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.forward import logits  # noqa: E402
from halfsafe.core.metrics import mean_kl  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.export.onnx_runners import OnnxDecoder  # noqa: E402
from halfsafe.export.onnx_split_k import PREFIX, groups_for, split_matmuls_  # noqa: E402
from halfsafe.runtime.profiles import get_profile  # noqa: E402

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(root, fp32 model, calibration ids, plain report, ort-webgpu report)."""
    root = tmp_path_factory.mktemp("splitk")
    model = make_tiny("gemma3_text")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.to(torch.bfloat16).save_pretrained(root / "original")
    save_char_tokenizer(root / "original", model.config)
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    plain = export_onnx(root / "converted", root / "plain")
    split = export_onnx(root / "converted", root / "split", runtime="ort-webgpu")
    return root, model.float().eval(), calib, plain, split


def _as_float32(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph in float32: float16 weights, constants, casts and graph values made float32."""
    def f32(t: onnx.TensorProto) -> None:
        if t.data_type == F16:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float32), t.name))

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for t in out.graph.initializer:
        f32(t)
    for node in out.graph.node:
        for a in node.attribute:
            if a.name == "to" and a.i == F16:
                a.i = F32
            if a.type == onnx.AttributeProto.TENSOR:
                f32(a.t)
    for v in list(out.graph.input) + list(out.graph.output):
        if v.type.tensor_type.elem_type == F16:
            v.type.tensor_type.elem_type = F32
    del out.graph.value_info[:]
    return out


def _run_cpu(proto: onnx.ModelProto, ids: np.ndarray, dtype=np.float16) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    n = ids.shape[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(n)[None]}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros([ids.shape[0], i.shape[1], 0, i.shape[3]], dtype)
    return session.run(["logits"], feeds)[0]


def test_groups_divide_k():
    assert groups_for(640, 16) == 16 and groups_for(640, 256) == 128 and groups_for(96, 64) == 32
    assert groups_for(63, 16) == 1 and groups_for(64, 1) == 1 and groups_for(64, 12) == 8


def test_profile_splits_every_product_with_static_k(exported):
    """The linears and the head become one batched MatMul each, under the rewrite's names, with K / G per group."""
    root, model, *_, split = exported
    linear, head, attention = get_profile("ort-webgpu").split_k
    layers = model.config.num_hidden_layers
    assert split.split_k["split"] == {"linear": 7 * layers, "head": 1, "attention": layers}
    assert split.head_groups == 1  # the torch-level head split (onnx_accumulate) is not stacked on it
    proto = onnx.load(str(root / "split" / ONNX_FILE))
    matmuls = [n for n in proto.graph.node if n.op_type == "MatMul"]
    kept = [n for n in matmuls if not n.name.startswith(PREFIX)]
    assert len(kept) == layers  # attention's PV (its K, the sequence, is not static); QK^T is split
    hidden = model.config.hidden_size
    g, gh = groups_for(hidden, linear), groups_for(hidden, head)
    assert g > 1 and gh > 1
    assert groups_for(model.config.head_dim, attention) > 1
    assert len(matmuls) == len(kept) + 7 * layers + gh + layers  # a batched MatMul per linear and QK^T, the head's slices
    shapes = [tuple(onnx.numpy_helper.to_array(n.attribute[0].t)) for n in proto.graph.node
              if n.op_type == "Constant" and n.name.startswith(PREFIX)]
    assert (g, 1, hidden // g, model.config.intermediate_size) in shapes  # gate/up's weight as [G, 1, K/G, N]
    bounds = sorted({s[0] for s in shapes if len(s) == 1 and s[0] >= 0})
    assert set(range(0, hidden + 1, hidden // gh)) <= set(bounds)  # the head's slices: consecutive runs of K / G


def test_split_graph_is_the_same_function_in_float32(exported):
    """Plain and split graphs made float32 agree to float32 rounding: the rewrite is exact in real arithmetic. Every
    kind of product split, attention's QK^T too."""
    import onnx_ir as ir

    root, _, calib, *_ = exported
    model = ir.load(str(root / "plain" / ONNX_FILE))
    done = split_matmuls_(model, linear=4, head=8, attention=4)
    assert done.split == {"linear": 14, "head": 1, "attention": 2}
    split = ir.serde.serialize_model(model)
    plain = onnx.load(str(root / "plain" / ONNX_FILE))
    ids = calib[1].numpy()
    a = _run_cpu(_as_float32(plain), ids, np.float32)
    b = _run_cpu(_as_float32(split), ids, np.float32)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), np.abs(a - b).max()
    assert np.abs(a - _run_cpu(plain, ids)).max() > 100 * np.abs(a - b).max()  # float16 would differ far more


def test_split_export_runs_like_the_plain_one_on_the_cpu_provider(exported):
    """ONNX Runtime's CPU provider (float32 sums): the split graph's greedy tokens and logits are the plain graph's."""
    root, fp32, calib, *_ = exported
    ids = calib[1][:, :16]
    plain, split = OnnxDecoder(root / "plain" / ONNX_FILE), OnnxDecoder(root / "split" / ONNX_FILE)
    assert split.greedy(ids.numpy(), 12) == plain.greedy(ids.numpy(), 12)
    a, b = plain.logits(ids.numpy()), split.logits(ids.numpy())
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()
    assert mean_kl(logits(fp32, ids).float(), torch.from_numpy(b)) < 1e-3


def test_cli_export_and_convert_take_the_profile(exported, tmp_path, capsys):
    root, *_ = exported
    assert main(["export", "onnx", str(root / "converted"), str(tmp_path / "e"), "--runtime", "ort-webgpu"]) == 0
    proto = onnx.load(str(tmp_path / "e" / ONNX_FILE))
    assert any(n.name.startswith(PREFIX) for n in proto.graph.node)
    assert main(["convert", str(root / "original"), str(tmp_path / "c"), "--seq-len", "32", "--max-samples", "2",
                 "--to", "onnx", "--runtime", "ort-webgpu"]) == 0
    proto = onnx.load(str(tmp_path / "c" / ONNX_FILE))
    assert any(n.name.startswith(PREFIX) for n in proto.graph.node)


# ---------------------------------------------------------------------------------------------------------------
# The real WebGPU provider (float16 running sums), on Mesa's lavapipe
# ---------------------------------------------------------------------------------------------------------------


def _wide_tiny(root: Path):
    """A tiny Gemma 3 wide enough (hidden 1024, K up to 2048) for float16 running sums to cost accuracy; one layer,
    a 256-token vocabulary, saved with a character tokenizer, converted."""
    from transformers import Gemma3TextConfig

    from halfsafe.io.loading import model_class_for

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              max_position_embeddings=128, sliding_window=512, layer_types=["full_attention"],
                              attn_implementation="eager")
    model = model_class_for(config)(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
    model.to(torch.bfloat16).save_pretrained(root / "original")
    save_char_tokenizer(root / "original", model.config)
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    return model.float().eval()


@pytest.mark.skipif(webgpu.adapter_missing() is not None, reason=webgpu.adapter_missing() or "")
def test_split_is_closer_to_fp32_on_real_webgpu(tmp_path):
    model = _wide_tiny(tmp_path)
    export_onnx(tmp_path / "converted", tmp_path / "plain")
    export_onnx(tmp_path / "converted", tmp_path / "split", runtime="ort-webgpu")
    ids = make_samples([default_text()], None, model.config.vocab_size, 24, 1)[0]
    ref = logits(model, ids).double()
    env = webgpu.runtime_env()
    errors = {}
    for name in ("plain", "split"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "logits.f32"
            got = jsclient.run(tmp_path / name, "tjs4", ids=ids[0].tolist(), new_tokens=1, logits_out=out,
                               device="webgpu", env=env, timeout=300)
            lg = torch.from_numpy(np.fromfile(out, np.float32).reshape(got["logits"]["dims"])).double()
        assert torch.isfinite(lg).all()
        errors[name] = float((lg - ref).pow(2).mean().sqrt())
    print(os.environ.get("PYTEST_CURRENT_TEST"), errors)
    assert errors["split"] < 0.5 * errors["plain"], errors
