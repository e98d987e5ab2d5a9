"""Weights too big to hold whole (a 262k-token embedding, a 27B model's MLP matrices), used a slice at a time.

A `WideWeight` stands in a streamed model's parameter slot: it reports the parameter's shape, dtype and device
but holds no values. The two ways models use such a matrix read only what they need from the shards:
an embedding lookup reads the rows of the ids it is given, a linear layer is computed a chunk of output rows at a
time into one output tensor. Each row is rescaled and cast exactly as the whole tensor would be (the rescales a
wide weight may have act on every element alike), and a row of a matrix product does not depend on the other
rows: lookups are the whole tensor's bit for bit, and so are products, as far as the matrix library computes an
output feature the same way whatever the number of features beside it. Chunks are a power of two rows long, where
that held for every case measured on CPU (tests compare), except a single token's fp32 product with a vocabulary of
odd size (GPT-2's 50257), which differs in the last bit of some logits, as a different thread count can. Any other
use (a product outside `linear`, an index other than one row) gets the whole tensor, loaded for that call only:
always correct, never light.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from .shards import row_spans

CHUNK_BYTES = 32 << 20  # rows read and multiplied at once by `linear`
MIN_CHUNK_ROWS = 256

_METADATA = {"shape", "dtype", "device", "ndim", "dim", "size", "numel", "nelement", "requires_grad", "is_floating_point",
             "is_complex", "element_size", "layout", "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested",
             "itemsize", "__len__", "names", "grad", "is_leaf", "grad_fn"}


class WideWeight(torch.Tensor):
    """Parameter `name` of the streamed model `source`, read from its shards a slice at a time (module docstring)."""

    @staticmethod
    def __new__(cls, source, name: str, shape, dtype: torch.dtype, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        t.source, t.param = source, name
        return t

    def __init__(self, source, name, shape, dtype, device) -> None:
        super().__init__()

    def __repr__(self) -> str:
        return f"WideWeight({self.param}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.source.rows(self.param, start, stop)

    def whole(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])

    def chunk_rows(self) -> int:
        """Rows per chunk: a power of two (at least MIN_CHUNK_ROWS), so that chunk boundaries fall where a matrix
        product's own blocking does (see the module docstring)."""
        rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // max(1, self.shape[1] * self.element_size()))
        return 1 << (rows.bit_length() - 1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        first, weight = _arg(args, 0, kwargs.get("input")), _arg(args, 1, kwargs.get("weight"))
        # F.embedding hands its options over by name
        if func is F.embedding and isinstance(weight, WideWeight) and kwargs.get("max_norm") is None:
            return _embedding(first, weight)  # (max_norm renormalises rows in place: whole, below)
        if func is F.linear and isinstance(weight, WideWeight) and not isinstance(first, WideWeight):
            return _linear(first, weight, _arg(args, 2, kwargs.get("bias")))
        row = _one_row(func, args)
        if row is not None:  # weight[i] or weight[i, :] (Gemma 4 reads the pad token's row on every forward)
            return args[0].source.gather(args[0].param, torch.tensor([row]))[0]
        args, kwargs = tree_map(_whole, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_whole, (args, kwargs or {}))
        return func(*args, **kwargs)


def _arg(args: tuple, i: int, default=None):
    return args[i] if len(args) > i else default


def _is_metadata(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA


def _one_row(func, args: tuple) -> int | None:
    """The row `weight[i]` / `weight[i, :]` asks for (negative i counted from the end), else None."""
    if func is not torch.Tensor.__getitem__ or len(args) != 2 or not isinstance(args[0], WideWeight):
        return None
    index = args[1]
    if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
        index = index[0]
    if isinstance(index, bool) or not isinstance(index, int) or not -args[0].shape[0] <= index < args[0].shape[0]:
        return None
    return index % args[0].shape[0]


def _whole(x):
    return x.whole() if isinstance(x, WideWeight) else x


def _embedding(ids: torch.Tensor, weight: WideWeight) -> torch.Tensor:
    """`F.embedding(ids, weight)` from the rows `ids` name (padding_idx only matters for gradients)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return weight.source.gather(weight.param, unique)[inverse]


def _linear(x: torch.Tensor, weight: WideWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, a chunk of output features at a time, each written into its place in one output."""
    out = None
    n = weight.shape[0]
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])  # 2-d: a 3-d input whose batch stride matmul cannot fold would copy each slice
    for start, stop in row_spans(n, weight.chunk_rows()):
        part = F.linear(x, weight.rows(start, stop), None if bias is None else _whole(bias)[start:stop])
        if out is None:
            out = torch.empty((*part.shape[:-1], n), dtype=part.dtype, device=part.device)
        out[..., start:stop] = part
        del part
    return out.view(*lead, n)
