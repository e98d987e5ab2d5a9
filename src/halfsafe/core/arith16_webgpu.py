"""float16 ops as ONNX Runtime's WebGPU provider computes them (onnxruntime-node 1.30.0 on Mesa's lavapipe).

Float16 values held in float32 tensors, as in halfsafe.core.arith16. What the shaders write (read from the WGSL
ONNX Runtime generates, runtime.profiles names the kernels) and what the Vulkan driver does with it (measured):
- every float16 operation is rounded to float16 on its own (round to nearest even, subnormals kept, overflow to
  inf); `a * b + c` is two roundings, and so is WGSL's `fma()` on float16;
- `exp(x)` is `exp2(x * log2(e))` with the product rounded to float16 and log2(e) a float16 constant (1.4424):
  up to 0.5% off for |x| <= 10 (measured over every float16), ten float16 ulps, where a correctly rounded exp is
  off by half of one. tanh, sigmoid and the GELUs inherit it.
tests/test_ort_webgpu_ops.py checks each function against the runtime, the elementwise ones on every finite float16.
"""

from __future__ import annotations

import math

import torch

from .arith16 import r16, scalar16

LOG2E = scalar16(math.log2(math.e))  # 1.4423828125: the float16 constant the shader multiplies by
SOFTMAX_START_MAX = -65504.0  # a lane's running max before it reads anything (`x_value_t(-65504.0h)`)


def exp16(x: torch.Tensor) -> torch.Tensor:
    """WGSL `exp` of float16 values: exp2 of the float16 product x * 1.4424, rounded once to float16."""
    return r16(torch.exp2(r16(x.float() * LOG2E).double()))


def tanh16(x: torch.Tensor) -> torch.Tensor:
    """The shaders' tanh of float16 (Tanh, and inside Gelu): sign(x) * (1 - e) / (1 + e), e = exp(-2|x|)."""
    x = r16(x.float())
    e = exp16(r16(-2.0 * x.abs()))
    return r16(r16(torch.sign(x) * r16(1.0 - e)) / r16(1.0 + e))


def sigmoid16(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid of float16: 1 / (1 + exp(-x)) (SiLU exports as x * Sigmoid(x))."""
    return r16(1.0 / r16(1.0 + exp16(-r16(x.float()))))


def quick_gelu16(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """com.microsoft QuickGelu, x * sigmoid(alpha * x), which ONNX Runtime fuses SiLU's Sigmoid and Mul into (alpha 1):
    v = alpha * x, s = 1 / (1 + exp(-v)) for v >= 0 and 1 - 1 / (1 + exp(v)) below, then x * s, in float16."""
    a = r16(x.float())
    v = r16(a * scalar16(alpha))
    positive = r16(1.0 / r16(1.0 + exp16(-v)))
    negative = r16(1.0 - r16(1.0 / r16(1.0 + exp16(v))))
    return r16(a * torch.where(v >= 0, positive, negative))


def pow16(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """Pow of float16 by a constant: x * x for 2, sqrt for 0.5, else sign * pow(|x|, p) computed in float32 and
    rounded (binary_elementwise_ops.cc's pow_custom). Lavapipe's float32 pow is exp2(p * log2|x|) with its own
    approximations: for p = 3, 8 of the 63488 finite float16 differ from this one by an ulp (measured)."""
    x = r16(x.float())
    if exponent == 0:
        return torch.ones_like(x)
    if exponent == 2:
        return r16(x * x)
    if exponent == 0.5:
        return r16(torch.sqrt(x))
    odd = round(abs(exponent) % 2.0) == 1.0
    sign = torch.where(torch.tensor(odd), torch.sign(x), torch.ones_like(x))
    return r16(sign * r16(torch.exp2(exponent * torch.log2(x.abs()))))


def gelu_tanh16(x: torch.Tensor) -> torch.Tensor:
    """ONNX Gelu(approximate="tanh") as the shader writes it, each step in float16:
    `a * (0.5 + 0.5 * tanh(a * (0.0357 * a * a + 0.798)))`, tanh as tanh16."""
    a = r16(x.float())
    inner = r16(a * r16(r16(r16(scalar16(0.035677408136300125) * a) * a) + scalar16(0.7978845608028654)))
    return r16(a * r16(0.5 + r16(0.5 * tanh16(inner))))


def vector_width(n: int) -> int:
    """How many elements the provider packs into one vector along a dimension of n: 4, 2 or 1."""
    return 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1


def _merge(max_a, sum_a, max_b, sum_b):
    """Two (running max, sum of exp(x - max)) pairs as one, in float16: each sum rescaled to the larger max."""
    top = torch.maximum(max_a, max_b)
    scaled_a = r16(sum_a * exp16(r16(max_a - top)))
    scaled_b = r16(sum_b * exp16(r16(max_b - top)))
    return top, r16(scaled_a + scaled_b)


def softmax16(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim as the provider's Softmax shader computes it (online softmax), in float16.

    The row is read as vectors of vector_width(n); a workgroup of 64 lanes (256 when the tensor is one row) runs
    over it, lane j reading vectors j, j + 64, ...: per vector, its max, the new running max m, the exps of
    (x - m) added left to right, and the lane's sum rescaled by exp(old m - m) before that is added. The lanes then
    merge in halves (lanes i and i + 32, then i and i + 16, ...), each sum rescaled to the larger max. Output:
    exp(x - max) / sum."""
    x = r16(x.float())
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    width = vector_width(n)
    lanes = 256 if rows == 1 else 64
    flat = x.reshape(rows, n // width, width)
    steps = max(1, -(-flat.shape[1] // lanes))
    # padding with -inf vectors leaves a lane as it was: new max = old max, exp(-inf) = 0, sum * exp(0) = sum
    padded = torch.full((rows, steps * lanes, width), -math.inf)
    padded[:, :flat.shape[1]] = flat
    padded = padded.reshape(rows, steps, lanes, width)
    run_max = torch.full((rows, lanes), SOFTMAX_START_MAX)
    run_sum = torch.zeros(rows, lanes)
    for s in range(steps):
        v = padded[:, s]
        new_max = torch.maximum(run_max, v.amax(-1))
        e = exp16(r16(v - new_max.unsqueeze(-1)))
        vector_sum = e[..., 0]
        for j in range(1, width):
            vector_sum = r16(vector_sum + e[..., j])
        run_sum = r16(r16(run_sum * exp16(r16(run_max - new_max))) + vector_sum)
        run_max = new_max
    size = lanes
    while size > 1:
        half = size // 2
        run_max, run_sum = _merge(run_max[:, :half], run_sum[:, :half], run_max[:, half:size], run_sum[:, half:size])
        size = half
    row_max, row_sum = run_max[:, :1], run_sum[:, :1]
    y = r16(exp16(r16(x.reshape(rows, n) - row_max)) / row_sum)
    return torch.nan_to_num(y.clamp_min(0.0), nan=0.0).reshape(x.shape)  # `max(value, 0)`: NaN (0/0) -> 0


def lane_sum(x: torch.Tensor, lanes: int = 64) -> torch.Tensor:
    """Sum over the last dim as the provider's ReduceSum/ReduceMean shader adds it up, in x's own float dtype (float32
    here; arith16.sum16 is the float16 one): lane j adds elements j, j + lanes, ... in order, then lane i adds lane
    i + ceil(w / 2) while w, starting at min(n, lanes), halves (reduction_ops.cc). Shape [..., n] -> [...]."""
    n = x.shape[-1]
    steps = -(-n // lanes)
    padded = torch.nn.functional.pad(x, (0, steps * lanes - n)).reshape(*x.shape[:-1], steps, lanes)
    acc = padded[..., 0, :]
    for s in range(1, steps):
        acc = acc + padded[..., s, :]
    width = min(n, lanes)
    acc = acc[..., :width]
    while width > 1:
        half = (width + 1) // 2
        acc = torch.cat([acc[..., : width - half] + acc[..., half:width], acc[..., width - half: half]], dim=-1)
        width = half
    return acc[..., 0]


def mean32(x: torch.Tensor, lanes: int = 64) -> torch.Tensor:
    """ReduceMean over the last dim of a float32 tensor: lane_sum, divided by n. Shape [..., n] -> [...]."""
    x = x.float()
    return lane_sum(x, lanes) / torch.tensor(float(x.shape[-1]))


def layer_norm16(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The provider's fused LayerNormalization of float16 (nn/layer_norm.cc): the mean and the mean of squares in
    float32, inverseSqrt(mean(x^2) - mean^2 + eps) in float32; then `(x - mean) * inv_std * scale + bias` in float16,
    mean and inv_std rounded to float16 first, each step rounded. (The float32 sums are PyTorch's, in another order
    than the shader's lanes: they can move mean or inv_std across a float16 rounding boundary, rarely.)"""
    x = r16(x.float())
    mean = x.mean(-1, keepdim=True)
    inv_std = torch.rsqrt((x * x).mean(-1, keepdim=True) - mean * mean + torch.tensor(eps, dtype=torch.float32))
    y = r16(r16(x - r16(mean)) * r16(inv_std))
    if weight is not None:
        y = r16(y * r16(weight.float()))
    if bias is not None:
        y = r16(y + r16(bias.float()))
    return y
