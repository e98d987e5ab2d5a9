"""onnx's reference evaluator computing an exported graph as a runtime profile says (halfsafe.runtime.profiles).

The reference evaluator computes float16 ops with numpy in float16, but numpy's float16 `matmul` accumulates in
float32 (a dot product of 4096 ones gives 4096, where a float16 running sum stops at 2048), so an all-float16 graph
run by it still has PyTorch's matmul arithmetic. `profile_evaluator` swaps in the profile's own arithmetic, the same
functions `verify --runtime` emulates with (halfsafe.core.arith16):
- MatMul with a constant operand (a linear layer's weight) under `matmul_chunk`: float32 dot products of runs of
  `matmul_chunk` k, each rounded to float16 and added to a float16 running sum (ONNX Runtime WebGPU MatMulNBits);
- MatMul of two activations (attention's QK^T and PV) the same way under `attention_fp16`, and Softmax as
  arith16.softmax16 (max, Sub, Exp, ReduceSum, Div, each rounded to float16);
- ReduceMean and ReduceSum of float16 under the norm-statistics profiles as a workgroup reduction (arith16.sum16:
  `lanes` strided running sums, then a pairwise tree), as ONNX Runtime WebGPU's ReduceSharedProgram adds up.
Ops on float32 tensors (the float32 logits the graph ends with) keep numpy's arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import arith16
from ..runtime.profiles import RuntimeProfile


def constant_names(graph) -> set[str]:
    """Names whose values do not depend on a graph input: initializers, Constant outputs and what is computed
    from those alone (a weight's Transpose or Cast)."""
    const = {t.name for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" or (node.input and all(i in const for i in node.input if i)):
            const.update(node.output)
    return const


def chunked_matmul16(a: np.ndarray, b: np.ndarray, chunk: int) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] (numpy broadcasting) with float16 accumulation over runs of `chunk` k,
    as arith16.matmul16 computes a linear layer. float16 in, float16 out."""
    x, w = torch.from_numpy(np.asarray(a, np.float32)), torch.from_numpy(np.asarray(b, np.float32))
    if x.dim() == 1 or w.dim() == 1:
        raise ValueError("chunked_matmul16: 1-D operands are not used by exported linears or attention")
    k = x.shape[-1]
    acc = None
    for start in range(0, k, chunk):
        part = arith16.r16(torch.matmul(x[..., start:start + chunk], w[..., start:start + chunk, :]))
        acc = part if acc is None else arith16.r16(acc + part)
    return acc.numpy().astype(np.float16)


def _reduce16(data: np.ndarray, axes, keepdims: int, mean: bool, lanes: int) -> np.ndarray:
    x = torch.from_numpy(np.asarray(data, np.float32))
    dims = sorted(int(a) % x.dim() for a in (range(x.dim()) if axes is None or len(axes) == 0 else axes))
    rest = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*rest, *dims)
    flat = moved.reshape(*moved.shape[:len(rest)], -1)
    out = arith16.mean16(flat, lanes) if mean else arith16.sum16(flat, lanes)
    if keepdims:
        out = out.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return out.numpy().astype(np.float16)


def profile_ops(profile: RuntimeProfile, constants: set[str]) -> list[type]:
    """OpRun classes for `ReferenceEvaluator(new_ops=...)`: the float16 ops `profile` computes differently from
    numpy. Empty for a profile that keeps PyTorch's arithmetic."""
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_matmul import numpy_matmul
    from onnx.reference.ops.op_softmax import Softmax as NumpySoftmax

    ops: list[type] = []
    lanes = profile.lanes

    if profile.matmul_chunk or profile.attention_fp16:
        chunk = profile.matmul_chunk or 32

        class MatMul(OpRun):
            def _run(self, a, b):
                linear = any(name in constants for name in self.onnx_node.input)
                fp16 = a.dtype == np.float16 and b.dtype == np.float16
                if fp16 and (profile.matmul_chunk if linear else profile.attention_fp16):
                    return (chunked_matmul16(a, b, chunk),)
                return (numpy_matmul(a, b),)

        ops.append(MatMul)

    if profile.attention_fp16:

        class Softmax(NumpySoftmax):
            def _run(self, X, axis=None):
                axis = self.axis if axis is None else axis
                if X.dtype != np.float16 or axis not in (-1, X.ndim - 1):
                    return super()._run(X, axis=axis)
                return (arith16.softmax16(torch.from_numpy(X.astype(np.float32)), lanes).numpy().astype(np.float16),)

        ops.append(Softmax)

    if profile.norm_stats_fp16:

        def reduction(op: str, mean: bool) -> type:
            def _run(self, data, axes=None, keepdims=1, noop_with_empty_axes=0):
                empty = axes is None or len(axes) == 0
                if empty and noop_with_empty_axes:
                    return (data,)
                if data.dtype != np.float16:
                    axis = None if empty else tuple(int(a) for a in axes)
                    f = np.mean if mean else np.sum
                    return (np.asarray(f(data, axis=axis, keepdims=bool(keepdims), dtype=data.dtype)),)
                return (_reduce16(data, axes, keepdims, mean, lanes),)

            return type(op, (OpRun,), {"_run": _run})

        ops += [reduction("ReduceMean", True), reduction("ReduceSum", False)]
    return ops


def profile_evaluator(proto, profile: RuntimeProfile):
    """A ReferenceEvaluator for `proto` computing its float16 ops under `profile` (see the module docstring)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(proto, new_ops=profile_ops(profile, constant_names(proto.graph)) or None)
