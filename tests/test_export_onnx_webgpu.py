"""`halfsafe export onnx` (`--split-k`): matrix products' K split into groups added pairwise
(halfsafe.export.onnx_split_k), for ONNX Runtime's WebGPU provider, whose float16 MatMul keeps one float16 running sum.
By default each product in the groups the ort-webgpu profile's rule gives its K; `--split-k none` the plain graph.

A tiny Gemma 3 blown past fp16's range (tests/stress.py), converted, exported plainly and split. The rewrite must
compute the same function: the graphs made float32 (every float16 weight, cast and value) agree to float32 rounding
on ONNX Runtime's CPU provider. The split graph runs in transformers.js on the CPU provider as the plain one does.
The CLI's default export and `--split-k` rules split each product as the rule says for its kind and K, and a bad
rule is refused in one line, nothing written. On the real WebGPU provider (Mesa's lavapipe, scripts/install-webgpu;
skipped without it) a wider tiny model's logits are closer to fp32 with the default export than with the plain one.
"""

from __future__ import annotations

import json
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
from halfsafe.export.onnx_split_k import PREFIX, split_matmuls_  # noqa: E402
from halfsafe.runtime.profiles import SplitK, get_profile  # noqa: E402
from halfsafe.runtime.profiles import split_groups as groups_for  # noqa: E402

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
SIXTEEN = (16, 16, 16)  # every kind of product's K in 16 groups, where it divides


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
    plain = export_onnx(root / "converted", root / "plain", split_k=SplitK())
    split = export_onnx(root / "converted", root / "split", runtime="ort-webgpu", split_k=SplitK(groups=SIXTEEN))
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


def test_group_counts_split_every_product_with_static_k(exported):
    """The linears and the head become one batched MatMul each, under the rewrite's names, with K / G per group."""
    root, model, *_, split = exported
    linear, head, attention = SIXTEEN
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


def _expected_groups(config, rule: SplitK) -> dict:
    """kind -> {K: G} of the products `rule` splits in a Gemma 3 decoder with `config`: q, k, v, gate, up and the
    head read the hidden size, o the heads' outputs, down the intermediate size, QK^T the head dimension."""
    ks = {"linear": {config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size},
          "head": {config.hidden_size}, "attention": {config.head_dim}}
    groups = {kind: {k: rule.groups_for(kind, k) for k in sorted(kk)} for kind, kk in ks.items()}
    return {kind: {k: g for k, g in gs.items() if g > 1} for kind, gs in groups.items() if max(gs.values()) > 1}


def _split_products(proto) -> dict:
    """kind -> {K: G} read back from the graph: each batched MatMul's A reshaped to [.., G, K / G], the head's
    slices (their bounds: K / G apart)."""
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t).tolist() for n in proto.graph.node
              if n.op_type == "Constant" and n.name.startswith(PREFIX)}
    producer = {o: n for n in proto.graph.node for o in n.output}
    found: dict = {}
    for n in proto.graph.node:
        if n.op_type != "MatMul" or not n.name.startswith(PREFIX):
            continue
        a = producer.get(n.input[0])
        if a is not None and a.op_type == "Slice":  # the head: one MatMul per slice of K
            lo, hi = consts[a.input[1]][0], consts[a.input[2]][0]
            found.setdefault("head", {}).setdefault("runs", set()).add((lo, hi))
            continue
        shape = consts[producer[a.input[0]].input[1]]  # Transpose <- Reshape(A, [0.., G, K / G])
        # a weight is reshaped to [G, 1.., K / G, N]; attention's computed B reshaped, then transposed
        kind = "linear" if producer[n.input[1]].op_type == "Reshape" else "attention"
        found.setdefault(kind, {})[shape[-2] * shape[-1]] = shape[-2]
    if "head" in found:
        runs = sorted(found["head"].pop("runs"))
        found["head"] = {runs[-1][1]: len(runs)}
    return found


@pytest.mark.parametrize("rule", [None, "terms:16", "terms:32", "terms:64,16,8", "none", "2,8,4"])
def test_cli_export_splits_each_product_as_the_rule_says(exported, tmp_path, rule):
    """`export onnx` by default (the ort-webgpu profile's rule), by a bound on the terms (terms:16: hidden 64 in 4
    groups, intermediate 128 in 8, QK^T's 16 whole; terms:32: 2, 4, whole; terms:64,16,8: a bound per kind, the
    linears, the head and QK^T), plain, by counts: every product's groups
    read back from the graph are the rule's for its kind and K, and the report says the same."""
    root, model, *_ = exported
    args = ["export", "onnx", str(root / "converted"), str(tmp_path / "e"), "--json", str(tmp_path / "e.json")]
    assert main(args + ([] if rule is None else ["--split-k", rule])) == 0
    split = get_profile("ort-webgpu").split_k if rule is None else SplitK.parse(rule)
    want = _expected_groups(model.config, split)
    if rule == "terms:16":
        assert want == {"linear": {64: 4, 128: 8}, "head": {64: 4}}
    if rule == "terms:64,16,8":
        assert want == {"linear": {128: 2}, "head": {64: 4}, "attention": {16: 2}}
    assert _split_products(onnx.load(str(tmp_path / "e" / ONNX_FILE))) == want
    report = json.loads((tmp_path / "e.json").read_text())["split_k"]
    assert {kind: {int(k): g for k, g in gs.items()} for kind, gs in report.get("groups", {}).items()} == want
    assert report.get("rule", SplitK().to_dict()) == split.to_dict()


def test_cli_convert_to_onnx_takes_the_rule_and_the_profile(exported, tmp_path):
    root, model, *_ = exported
    assert main(["export", "onnx", str(root / "converted"), str(tmp_path / "e"), "--runtime", "ort-webgpu"]) == 0
    assert _split_products(onnx.load(str(tmp_path / "e" / ONNX_FILE))) == _expected_groups(
        model.config, get_profile("ort-webgpu").split_k)
    assert main(["convert", str(root / "original"), str(tmp_path / "c"), "--seq-len", "32", "--max-samples", "2",
                 "--to", "onnx", "--split-k", "terms:16"]) == 0
    assert _split_products(onnx.load(str(tmp_path / "c" / ONNX_FILE))) == {"linear": {64: 4, 128: 8}, "head": {64: 4}}


@pytest.mark.parametrize("args, says", [
    (["export", "onnx", "{converted}", "{out}", "--split-k", "4,4"], "give none, terms:N"),
    (["export", "onnx", "{converted}", "{out}", "--split-k", "terms:0"], "at least 1"),
    (["export", "onnx", "{converted}", "{out}", "--split-k", "terms:64,64"], "give none, terms:N"),
    (["export", "onnx", "{converted}", "{out}", "--split-k", "0,2,2"], "at least 1"),
    (["export", "gguf", "{converted}", "{out}", "--split-k", "none"], "--split-k is for export onnx"),
    (["convert", "{original}", "{out}", "--split-k", "none"], "--split-k is for --to onnx"),
    (["convert", "{original}", "{out}", "--to", "gguf", "--split-k", "terms:64"], "--split-k is for --to onnx"),
])
def test_cli_refuses_a_bad_split_in_one_line(exported, tmp_path, capsys, args, says):
    root, *_ = exported
    paths = {"converted": root / "converted", "original": root / "original", "out": tmp_path / "out"}
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


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
def test_default_export_is_closer_to_fp32_on_real_webgpu(tmp_path):
    """The wide tiny's K's are Gemma 3 270M's or longer: the default rule splits them (asserted), and its logits on
    the real provider are closer to fp32's than the plain graph's."""
    model = _wide_tiny(tmp_path)
    export_onnx(tmp_path / "converted", tmp_path / "plain", split_k=SplitK())
    report = export_onnx(tmp_path / "converted", tmp_path / "split")
    assert report.split_k["split"]["linear"] == 7 and report.split_k["split"]["head"] == 1
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
