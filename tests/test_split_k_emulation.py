"""The split-K graph (halfsafe.export.onnx_split_k) against the `ort-webgpu` profile's emulation of it
(runtime.emulate's linears, kernels.ort_webgpu's QK^T): each is checked against its own expectations elsewhere
(tests/test_export_onnx_webgpu.py, tests/test_ort_webgpu_ops.py); here against each other, one product at a time.

For every kind of product (a linear's weight, the head that makes the logits, attention's QK^T) and K's that split
into 16, 8 or 4 groups, or fewer than asked, by a count per kind or by a bound on the terms per running sum
(SplitK(terms=T): K's of 64, 48, 96, 40 in groups of at most 16, 8 or 4 terms, and ones short enough to stay whole),
one MatMul is exported as a graph, split, and:
- its structure read back from the file: the number of groups, K / G per group, is the emulation's;
- run by onnx's reference evaluator (numpy: every float16 op rounded once, a MatMul's sum taken in float32; ONNX
  Runtime's CPU provider would keep the float16 graph in float32 between its ops), on small integers, each group of K's rows of B scaled by a
  power of two of its own, so that only what the structure decides rounds: where each group's sum is exact in
  float16, the output is the emulation's bit for bit (the same partials added in the same order); where it is exact
  in float32 only, it is each group's sum rounded once, then the pairwise float16 adds, for the emulation's group
  count and order and for no other near it (the inputs are checked to tell them apart);
- on ONNX Runtime's WebGPU provider (real float16 running sums, tests/webgpu.py; skipped without the adapter), on
  random inputs: the emulation's output bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ir = pytest.importorskip("onnx_ir")

import webgpu  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from halfsafe.core import arith16  # noqa: E402
from halfsafe.export.onnx_split_k import PREFIX, split_matmuls_  # noqa: E402
from halfsafe.runtime import emulate  # noqa: E402
from halfsafe.runtime.kernels import ort_webgpu  # noqa: E402
from halfsafe.runtime.profiles import SplitK, get_profile  # noqa: E402

M, N, HEADS = 3, 24, 2
# name: (kind, K, groups asked or "tT", at most T terms per running sum): K's that split whole, in fewer groups than
# asked, and not past K / G = 1; by terms, in groups of T, of fewer (48 / 8 = 6), of K's odd part (40 / 8 = 5), or whole
CASES = {
    "linear-64-16": ("linear", 64, 16), "linear-48-16": ("linear", 48, 16), "linear-40-16": ("linear", 40, 16),
    "linear-32-2": ("linear", 32, 2), "head-64-16": ("head", 64, 16), "head-96-8": ("head", 96, 8),
    "head-20-16": ("head", 20, 16), "attention-32-4": ("attention", 32, 4), "attention-16-16": ("attention", 16, 16),
    "attention-24-16": ("attention", 24, 16), "linear-15-16": ("linear", 15, 16),
    "linear-64-t16": ("linear", 64, "t16"), "linear-48-t8": ("linear", 48, "t8"), "linear-40-t4": ("linear", 40, "t4"),
    "linear-32-t32": ("linear", 32, "t32"), "head-96-t16": ("head", 96, "t16"), "head-20-t64": ("head", 20, "t64"),
    "attention-32-t8": ("attention", 32, "t8"), "attention-16-t16": ("attention", 16, "t16"),
}


def _profile(kind: str, asked: int | str):
    if isinstance(asked, str):
        return replace(get_profile("ort-webgpu"), split_k=SplitK(terms=int(asked[1:])))
    return replace(get_profile("ort-webgpu"), split_k={"linear": (asked, 1, 1), "head": (1, asked, 1),
                                                       "attention": (1, 1, asked)}[kind])


def _emulated_groups(kind: str, k: int, asked: int | str) -> int:
    """How many groups the emulation cuts this product's K into, from the profile as the emulation reads it."""
    profile = _profile(kind, asked)
    if kind == "attention":
        qk = ort_webgpu.attention(profile)[1]
        return qk.keywords["split"].groups_for("attention", k) if hasattr(qk, "keywords") else 1
    return profile.linear_split(kind, k)


def _seed(k: int, asked: int | str) -> int:
    return k * 31 + (asked if isinstance(asked, int) else 1000 + int(asked[1:]))


def _split_graph(kind: str, k: int, asked: int, w: np.ndarray | None) -> onnx.ModelProto:
    """One float16 MatMul as the export writes it (a linear's or the head's weight an initializer, the head's output
    the graph's `logits`; attention's two inputs computed), split as `export onnx --runtime ort-webgpu` splits it."""
    if kind == "attention":
        inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT16, [1, HEADS, M, k]),
                  helper.make_tensor_value_info("B", TensorProto.FLOAT16, [1, HEADS, k, N])]
        init, out_shape = [], [1, HEADS, M, N]
    else:
        inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT16, [1, M, k])]
        init, out_shape = [helper.make_tensor("B", TensorProto.FLOAT16, [k, N], w.tobytes(), raw=True)], [1, M, N]
    out = "logits" if kind == "head" else "Y"
    node = helper.make_node("MatMul", ["A", "B"], [out], name="product")
    graph = helper.make_graph([node], kind, inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT16, out_shape)],
                              initializer=init)
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9))
    split = _profile(kind, asked).onnx_split_k
    if split is not None:
        split_matmuls_(model, split)
    return ir.serde.serialize_model(model)


def _run_cpu(proto: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ReferenceEvaluator(proto).run(None, feeds)[0]


def _graph_groups(proto: onnx.ModelProto, kind: str, k: int) -> int:
    """The groups the split graph cuts K into, read back from it: 1 where the product was left whole; the head's
    slices' bounds, or the batched MatMul's [G, .., K / G] reshape."""
    nodes = list(proto.graph.node)
    if not any(n.name.startswith(PREFIX) for n in nodes):
        return 1
    matmuls = [n for n in nodes if n.op_type == "MatMul"]
    if kind == "head":
        consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t).tolist() for n in nodes if n.op_type == "Constant"}
        bounds = [(consts[s.input[1]][0], consts[s.input[2]][0]) for s in nodes if s.op_type == "Slice" and s.input[0] == "A"]
        g = len(matmuls)
        assert bounds == [(i * k // g, (i + 1) * k // g) for i in range(g)], bounds  # consecutive runs, in order
        return g
    (matmul,) = matmuls
    shapes = [onnx.numpy_helper.to_array(n.attribute[0].t).tolist() for n in nodes if n.op_type == "Constant"]
    g = next(s[-2] for s in shapes if len(s) >= 2 and s[-1] == k // s[-2] and s[-2] * s[-1] == k)
    assert matmul.input[0] != "A" and matmul.input[1] != "B"
    return g


def _emulated(kind: str, k: int, asked: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What the `ort-webgpu` profile's emulation computes for the product (float16 values)."""
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    profile = _profile(kind, asked)
    if kind == "attention":
        groups = _emulated_groups(kind, k, asked)
        return ort_webgpu._qk16(ta.float(), tb.float().transpose(-1, -2), groups).half().numpy()
    layer = torch.nn.Linear(k, N, bias=False, dtype=torch.float16)
    with torch.no_grad():
        layer.weight.copy_(tb.t())
    forward = emulate._patched_forward(layer, profile, head=layer if kind == "head" else None)
    assert forward is not None, "the profile leaves the product unemulated"
    with torch.no_grad():
        return forward(layer, ta).numpy()


def _grouped(kind: str, k: int, g: int, seed: int, top: int, exponents: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of integers in [-top, top], B's rows of each of `g` groups of K scaled by a power of two of their own
    (per column, in `exponents`): the partials are of very different sizes; top 3 keeps every group's sum (16 terms
    at most) exact in float16, top 63 in float32 only."""
    rng = np.random.default_rng(seed)
    lead = (1, HEADS) if kind == "attention" else (1,)
    a = rng.integers(-top, top + 1, (*lead, M, k)).astype(np.float16)
    scale = 2.0 ** rng.integers(*exponents, (*lead, g, 1, N))
    b = (rng.integers(-top, top + 1, (*lead, g, k // g, N)) * scale).reshape(*lead, k, N).astype(np.float16)
    if kind != "attention":
        b = b.reshape(k, N)
    return a, b


def _tree(parts: list, halves: bool) -> torch.Tensor:
    while len(parts) > 1:
        h = len(parts) // 2
        pairs = zip(parts[:h], parts[h:]) if halves else zip(parts[0::2], parts[1::2])
        parts = [arith16.r16(x + y) for x, y in pairs]
    return parts[0]


def _other_structures(kind: str, k: int, g: int, a: np.ndarray, b: np.ndarray) -> dict:
    """The product cut into other group counts and added in other orders, each group's sum rounded once to float16
    (exact before: `_grouped`), then the pairwise float16 adds: what a graph that cut K otherwise would give."""
    ta, tb = torch.from_numpy(a).double(), torch.from_numpy(b).double()
    out = {}
    for groups in {max(g // 2, 1), g, g * 2 if k % (g * 2) == 0 else g}:
        for halves in (True, False):
            bounds = [k * i // groups for i in range(groups + 1)]
            parts = [arith16.r16((ta[..., lo:hi] @ tb[..., lo:hi, :]).float()) for lo, hi in zip(bounds, bounds[1:])]
            out[groups, halves] = _tree(parts, halves).half().numpy()
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_split_graph_is_the_structure_the_emulation_assumes(name):
    kind, k, asked = CASES[name]
    g = _emulated_groups(kind, k, asked)
    feeds = lambda a, b: {"A": a, **({"B": b} if kind == "attention" else {})}  # noqa: E731
    # every group's sum exact in float16: the graph computes the emulation's own output, bit for bit
    a, b = _grouped(kind, k, g, _seed(k, asked), 3, (-7, 8))
    proto = _split_graph(kind, k, asked, None if kind == "attention" else b)
    assert _graph_groups(proto, kind, k) == g, "the graph cuts K into other groups than the emulation"
    got, want = _run_cpu(proto, feeds(a, b)), _emulated(kind, k, asked, a, b)
    assert got.dtype == np.float16 and np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} differ"
    # exact in float32 only: each group's sum rounds once; the emulation's group count and order, and no other
    a, b = _grouped(kind, k, g, _seed(k, asked) + 6 * k, 63, (-10, -3))
    proto = _split_graph(kind, k, asked, None if kind == "attention" else b)
    got = _run_cpu(proto, feeds(a, b))
    halves = kind != "head"  # the batched MatMul's Split adds halves; the head's slices, neighbours
    others = _other_structures(kind, k, g, a, b)
    assert np.isfinite(got).all() and np.array_equal(got, others[g, halves]), \
        f"{int((got != others[g, halves]).sum())} of {got.size} differ from {g} groups added {'by halves' if halves else 'as neighbours'}"
    differ = [s for s in others if s[0] != g or (g > 2 and s[1] != halves)]
    assert all(not np.array_equal(others[s], got) for s in differ), "these inputs cannot tell the structures apart"


def test_the_runtime_runs_the_split_graph_as_the_emulation_computes_it(webgpu_runtime, tmp_path):
    """ONNX Runtime's WebGPU provider (a float16 running sum in every MatMul) on every case's split graph, random
    float16 inputs: the emulation's output bit for bit."""
    runs, want = [], {}
    rng = np.random.default_rng(20261207)
    for name, (kind, k, asked) in sorted(CASES.items()):
        a = (rng.standard_normal((1, HEADS, M, k) if kind == "attention" else (1, M, k)) * 2).astype(np.float16)
        b = (rng.standard_normal((1, HEADS, k, N) if kind == "attention" else (k, N)) * 2).astype(np.float16)
        proto = _split_graph(kind, k, asked, None if kind == "attention" else b)
        (tmp_path / name).mkdir()
        onnx.save(proto, str(tmp_path / name / "model.onnx"))
        runs.append((tmp_path / name / "model.onnx", {"A": a, **({"B": b} if kind == "attention" else {})}))
        want[name] = _emulated(kind, k, asked, a, b)
    outs = webgpu.run_graphs(runs, tmp_path, webgpu_runtime.env)
    for name, out in zip(sorted(CASES), outs):
        (got,) = out.values()
        assert np.array_equal(got, want[name]), f"{name}: {int((got != want[name]).sum())} of {got.size} differ"
