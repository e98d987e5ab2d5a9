"""float16 arithmetic as fp16-only runtimes compute it, emulated exactly in float32 tensors.

Every function takes and returns float32 tensors whose values are float16 values (inf and NaN included), so the
results can be compared, summed up and measured without PyTorch's own float16 kernels (which on CPU accumulate in
float32). One float32 operation on float16 operands followed by rounding to float16 gives the correctly rounded
float16 result for +, -, x, / and sqrt: float32's 24-bit significand is at least 2 x 11 + 2 bits, the condition
under which double rounding is innocuous (S. Figueroa, "When is double rounding innocuous?", SIGNUM 1995).
rsqrt and exp are not correctly rounded on any GPU either; here they are float32's, rounded once to float16.
"""

from __future__ import annotations

import torch

from .threads import one_thread

FP16 = torch.float16


def r16(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to float16 (overflow -> inf, underflow -> subnormal or 0), held in float32."""
    return x.to(FP16).float()


def scalar16(value: float) -> float:
    """A Python number as a float16 constant in a graph stores it (an eps of 3.9e-9 becomes 0.0)."""
    return float(torch.tensor(value, dtype=torch.float32).to(FP16))


def sum16(x: torch.Tensor, lanes: int = 64) -> torch.Tensor:
    """Sum over the last dim in float16, as a workgroup reduction does: `lanes` running sums, lane j adding
    elements j, j + lanes, ... in order, then a pairwise tree over the lanes (each add rounded to float16).
    Shape [..., n] -> [...]. The order changes the rounding only: a sum of squares overflows wherever it is added
    up, since its partial sums never exceed its total."""
    x = r16(x.float())
    n = x.shape[-1]
    steps = -(-n // lanes)
    pad = steps * lanes - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    x = x.reshape(*x.shape[:-1], steps, lanes)
    acc = x[..., 0, :]
    for s in range(1, steps):
        acc = r16(acc + x[..., s, :])
    width = lanes
    while width > 1:  # DIV_CEIL-style halving: lane i adds lane i + ceil(width / 2)
        half = (width + 1) // 2
        top = acc[..., half:width]
        acc = torch.cat([r16(acc[..., : width - half] + top), acc[..., width - half: half]], dim=-1)
        width = half
    return acc[..., 0]


def mean16(x: torch.Tensor, lanes: int = 64) -> torch.Tensor:
    """ReduceMean over the last dim in float16: sum16, then divided by n (n itself a float16 constant)."""
    return r16(sum16(x, lanes) / scalar16(x.shape[-1]))


def rms_inv16(x: torch.Tensor, eps: float, lanes: int = 64) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, every step in float16 (Pow, ReduceMean, Add, Sqrt, Div):
    a square above 65504 is inf, so is the mean, and the factor is 0; an eps below fp16's smallest subnormal is 0,
    so an all-zero row gets inf. Shape [..., n] -> [..., 1]."""
    var = mean16(r16(x.float() * x.float()), lanes)
    return r16(torch.rsqrt(r16(var + scalar16(eps)))).unsqueeze(-1)


def layer_norm16(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                 lanes: int = 64) -> torch.Tensor:
    """LayerNorm over the last dim as ONNX's LayerNormalization function body computes it when every op is float16:
    ReduceMean, Sub, Pow, ReduceMean, Add eps, Sqrt, Div, Mul weight, Add bias. `Pow` overflows once
    |x - mean| > 255.9, and the inf variance turns the row into zeros (plus the bias)."""
    x = r16(x.float())
    d = r16(x - mean16(x, lanes).unsqueeze(-1))
    var = mean16(r16(d * d), lanes).unsqueeze(-1)
    y = r16(d / r16(torch.sqrt(r16(var + scalar16(eps)))))
    if weight is not None:
        y = r16(y * r16(weight.float()))
    if bias is not None:
        y = r16(y + r16(bias.float()))
    return y


def chunk_sums(x: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    """x [T, K] (float16 values), w [N, K] -> [T, N, C]: the float32 dot product of each run of `chunk`
    consecutive k, C = ceil(K / chunk). (Within a run the products are exact in float32; a kernel that also
    rounds inside the run rounds more, never less.)"""
    k = x.shape[-1]
    c = -(-k // chunk)
    pad = c * chunk - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
        w = torch.nn.functional.pad(w, (0, pad))
    return torch.einsum("tck,nck->tnc", x.reshape(x.shape[0], c, chunk), w.reshape(w.shape[0], c, chunk))


def running16(parts: torch.Tensor) -> torch.Tensor:
    """[..., C] chunk sums -> [...]: each rounded to float16 and added to a float16 running sum, in order."""
    acc = r16(parts[..., 0])
    for c in range(1, parts.shape[-1]):
        acc = r16(acc + r16(parts[..., c]))
    return acc


def sequential_matmul16(x: torch.Tensor, w: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """x [..., M, K] @ w [..., N, K]^T (batch dims broadcast) as one float16 running sum per output, k = 0, 1, ...:
    acc = r16(acc + r16(x_k * w_k)), starting from +0. Float16 values in float32 in and out.

    Computed in PyTorch's float16 (each CPU op is one float32 op rounded to float16: the same roundings, without the
    conversions), `block` output columns at a time so the running sums stay in cache, on one thread (K small ops
    per block: two threads on a busy CPU were 3-10x slower than one, measured on Gemma 3's head)."""
    a, b = r16(x.float()).to(FP16), r16(w.float()).to(FP16).transpose(-1, -2)  # b: [..., K, N]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
    out = torch.empty(*lead, a.shape[-2], b.shape[-1], dtype=torch.float32, device=x.device)
    with one_thread():
        for start in range(0, b.shape[-1], block):
            part = b[..., start:start + block].contiguous()
            acc = torch.zeros(*lead, a.shape[-2], part.shape[-1], dtype=FP16, device=x.device)
            product = torch.empty_like(acc)
            for k in range(a.shape[-1]):
                torch.mul(a[..., k:k + 1], part[..., k:k + 1, :], out=product)
                acc.add_(product)
            out[..., start:start + block] = acc.float()
    return out


def matmul16(x: torch.Tensor, w: torch.Tensor, chunk: int, rows: int = 4096) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T with float16 accumulation over runs of `chunk` (running16 of chunk_sums), float16
    values in float32. Output rows of w are taken `rows` at a time to bound the [T, rows, C] partial sums.
    A run of 1 is a plain float16 running sum of rounded products (sequential_matmul16, the same numbers)."""
    if chunk == 1:
        return sequential_matmul16(x, w)
    lead = x.shape[:-1]
    x2 = r16(x.float()).reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, w.shape[0], rows):
        out[:, start:start + rows] = running16(chunk_sums(x2, r16(w[start:start + rows].float()), chunk))
    return out.reshape(*lead, w.shape[0])


def split_matmul16(x: torch.Tensor, w: torch.Tensor, chunk: int, groups: int, halves: bool = True) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T with K cut into `groups` consecutive runs (a power of two dividing K: how many, the
    profile's SplitK decides), each product a matmul16, the partials then
    added pairwise in float16, as halfsafe.export.onnx_split_k writes the graph: `halves` (partial i + partial
    i + G/2, then again: a batched MatMul's Split and Add) or neighbours (0 + 1, 2 + 3, ...: the sliced head)."""
    k = x.shape[-1]
    bounds = [k * g // groups for g in range(groups + 1)]
    parts = [matmul16(x[..., a:b], w[:, a:b], chunk) for a, b in zip(bounds, bounds[1:])]
    while len(parts) > 1:
        h = len(parts) // 2
        pairs = zip(parts[:h], parts[h:]) if halves else zip(parts[0::2], parts[1::2])
        parts = [r16(a + b) for a, b in pairs]
    return parts[0]


def softmax16(x: torch.Tensor, lanes: int = 64) -> torch.Tensor:
    """Softmax over the last dim in float16: max, Sub, Exp, ReduceSum, Div, each rounded to float16."""
    x = r16(x.float())
    e = r16(torch.exp(r16(x - x.amax(dim=-1, keepdim=True))))
    return r16(e / sum16(e, lanes).unsqueeze(-1))
