"""The reference evaluator under a runtime profile computes the profile's float16 arithmetic, not numpy's.

numpy's float16 matmul accumulates in float32, so without `profile_ops` an "all-float16" graph still sums its
dot products in float32; these tests hold each swapped op to the arith16 function `verify --runtime` uses, on
one-node graphs and on a dot product whose float16 running sum overflows while its float32 sum is 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from halfsafe.core import arith16  # noqa: E402
from halfsafe.export.onnx_profile_ops import chunked_matmul16, constant_names, profile_evaluator  # noqa: E402
from halfsafe.runtime.profiles import PROFILES  # noqa: E402

RNG = np.random.default_rng(0)


def _graph(nodes, inputs, output, initializers=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in inputs],
                          [helper.make_tensor_value_info(output, TensorProto.FLOAT16, None)], list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_chunked_matmul16_is_arith16s_linear_and_overflows_where_float32_sums_do_not():
    x = RNG.standard_normal((5, 100)).astype(np.float16) * np.float16(8)
    w = RNG.standard_normal((100, 7)).astype(np.float16)
    got = chunked_matmul16(x, w, 32)
    want = arith16.matmul16(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(w.T.astype(np.float32)), 32)
    assert np.array_equal(got.astype(np.float32), want.numpy())
    # 32 products of 300 x 300 = 2.9e6 in the first run: inf in float16; the next run's -inf makes it NaN
    a = np.array([[300.0] * 32 + [-300.0] * 32], np.float16)
    b = np.full((64, 1), 300.0, np.float16)
    assert (a @ b)[0, 0] == 0  # numpy: float32 accumulation
    assert not np.isfinite(chunked_matmul16(a, b, 32)[0, 0])


def test_linear_matmul_is_chunked_under_fp16_accumulate_and_attention_is_not():
    w = numpy_helper.from_array(np.full((64, 1), 300.0, np.float16), "w")
    model = _graph([helper.make_node("MatMul", ["x", "w"], ["lin"]), helper.make_node("MatMul", ["x", "v"], ["att"]),
                    helper.make_node("Add", ["lin", "att"], ["y"])], ["x", "v"], "y", [w])
    assert constant_names(model.graph) == {"w"}  # "lin" is a linear's output: its MatMul has a constant operand
    x = np.array([[300.0] * 32 + [-300.0] * 32], np.float16)
    v = np.full((64, 1), 300.0, np.float16)
    feed = {"x": x, "v": v}
    (plain,) = profile_evaluator(model, PROFILES["torch"]).run(None, feed)
    assert plain[0, 0] == 0
    (acc,) = profile_evaluator(model, PROFILES["fp16-accumulate"]).run(None, feed)
    assert not np.isfinite(acc[0, 0])  # the linear's running sum overflows
    att_only = _graph([helper.make_node("MatMul", ["x", "v"], ["y"])], ["x", "v"], "y")
    assert profile_evaluator(att_only, PROFILES["fp16-accumulate"]).run(None, feed)[0][0, 0] == 0  # attention: PyTorch's
    assert not np.isfinite(profile_evaluator(att_only, PROFILES["all-fp16"]).run(None, feed)[0][0, 0])  # all-fp16: also in float16


def test_reductions_and_softmax_are_arith16s():
    x = (RNG.standard_normal((3, 4, 700)) * 40).astype(np.float16)
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    for op, want in (("ReduceMean", arith16.mean16), ("ReduceSum", arith16.sum16)):
        model = _graph([helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)], ["x"], "y", [axes])
        (got,) = profile_evaluator(model, PROFILES["fp16-norm-stats"]).run(None, {"x": x})
        assert got.shape == (3, 4, 1)
        assert np.array_equal(got[..., 0].astype(np.float32), want(torch.from_numpy(x.astype(np.float32))).numpy(), equal_nan=True)
    squares = _graph([helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["y"])],
                     ["x"], "y", [axes])
    big = np.full((1, 4096), 100.0, np.float16)  # squares 1e4 fit float16; their sum does not
    assert np.isinf(profile_evaluator(squares, PROFILES["fp16-norm-stats"]).run(None, {"x": big})[0]).all()
    model = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], ["x"], "y")
    (got,) = profile_evaluator(model, PROFILES["all-fp16"]).run(None, {"x": x})
    assert np.array_equal(got.astype(np.float32), arith16.softmax16(torch.from_numpy(x.astype(np.float32))).numpy())


def test_the_split_head_computes_the_same_logits_in_fewer_float16_running_sums():
    from torch import nn

    from halfsafe.export.onnx_accumulate import split_head_
    from halfsafe.runtime.profiles import get_profile

    class Head(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.lm_head = nn.Linear(k, 50, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    torch.manual_seed(0)
    x = torch.randn(3, 640)
    model = Head(640)
    want = model.lm_head(x)
    assert split_head_(model, get_profile("fp16-norm-stats")) == 1  # float32 sums: nothing to split
    assert split_head_(model, get_profile("all-fp16")) == 4
    assert torch.allclose(model.lm_head(x), want, rtol=0, atol=1e-5)  # the same function, summed in another order
    assert split_head_(Head(40), get_profile("all-fp16")) == 1  # K = 40: not two runs of 32
    assert split_head_(Head(100), get_profile("all-fp16")) == 3
