"""`export onnx --runtime P`: norms computed on an exact power-of-two prescale of their input, for runtimes that
compute norm statistics in float16 (halfsafe.runtime.profiles).

A norm is invariant under scaling its input by c except for eps: RMSNorm(x c; eps c^2) = RMSNorm(x; eps), and so is
LayerNorm. With c = 2^-k the product x c is exact in float16 and eps c^2 is exact in float32, so the graph computes
the same function, but the squares, their sum and mean see x c instead of the residual stream's x: a sum of squares
that passes 65504 in float16 (and zeroes the row through rsqrt(inf) = 0) stays in range, while the residual stream
keeps every bit it had. k is chosen per norm from the largest |input| measured on the embedded text, so that
width x (peak c)^2 stays under SUM_LIMIT (4 bits under 65504); a norm whose inputs are small gets c > 1, so its mean
of squares does not sink into float16's subnormals. Where c is small, eps c^2 can fall below float16's smallest
subnormal and round to 0 in an all-float16 graph: that changes a row only if its mean of squares is 0 as well
(eps / mean(x^2) does not depend on c).

The rewrite is made on the module before export (each norm's forward multiplies its input by c and uses eps c^2),
so the exporter writes the Mul by c into the norm's own subgraph, whatever ops the modeling code decomposes it into.
`fp16_statistics` makes the graph a float16 runtime computes: every float32 cast and constant made float16 (except
the float32 logits the graph ends with), for onnx's reference evaluator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..core.sites import Site
from ..core.stats import SiteCollector
from ..errors import HalfsafeError
from ..runtime.emulate import is_rms_norm
from ..runtime.profiles import RuntimeProfile

FP16_MAX = 65504.0
SUM_LIMIT = 2.0 ** 12  # the largest sum of squares wanted: 4 bits under 65504 for inputs past the measured peaks
SHIFT_RANGE = (-8, 40)  # c from 2^8 down to 2^-40
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


@dataclass(frozen=True)
class NormPrescale:
    name: str
    peak: float  # largest |input| measured
    width: int  # the normalized dim
    shift: int  # c = 2^-shift
    eps: float  # eps c^2, what the norm now adds

    def to_dict(self) -> dict:
        return {"peak": self.peak, "width": self.width, "shift": self.shift, "eps": self.eps}


def prescaled_norms(model: nn.Module, profile: RuntimeProfile) -> dict[str, nn.Module]:
    """The norms `profile` computes statistics of in float16: RMSNorm-type ones and/or nn.LayerNorm."""
    out = {}
    for name, m in model.named_modules():
        rms = is_rms_norm(m)
        if (rms or isinstance(m, nn.LayerNorm)) and profile.norm_stats_in_fp16(rms):
            out[name] = m
    return out


def _eps_name(m: nn.Module) -> str:
    for n in EPS_NAMES:
        if isinstance(getattr(m, n, None), float):
            return n
    raise HalfsafeError(f"{type(m).__name__} has no float eps ({', '.join(EPS_NAMES)}): the norm prescale cannot move it")


class NormPeaks(SiteCollector):
    """Largest |input| (and the normalized width) of each norm given, over every forward pass while it is on."""

    def __init__(self, model: nn.Module, norms: dict[str, nn.Module]) -> None:
        super().__init__(model)
        self.peaks: dict[str, tuple[float, int]] = {}
        try:
            for name in norms:
                self.watch(Site(name, "in"), name)
        except BaseException:
            self.remove()
            raise

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        x = t.detach()
        peak = float(x.abs().float().nan_to_num(posinf=FP16_MAX).max()) if x.numel() else 0.0
        self.peaks[site] = (max(peak, self.peaks.get(site, (0.0, 0))[0]), x.shape[-1])


def measure_peaks(model: nn.Module, norms: dict[str, nn.Module], samples: list[torch.Tensor]) -> dict[str, tuple[float, int]]:
    """Largest |input| (and the normalized width) of each norm, running `model` as it is (float16) on `samples`."""
    with NormPeaks(model, norms) as collector, torch.no_grad():
        for ids in samples:
            model(input_ids=ids.to(model.device))
    return collector.peaks


def choose_shift(peak: float, width: int) -> int:
    """The least k with width x (peak 2^-k)^2 <= SUM_LIMIT (within SHIFT_RANGE; 0 for a norm never reached)."""
    if peak <= 0 or width <= 0:
        return 0
    k = math.ceil(0.5 * math.log2(width * peak * peak / SUM_LIMIT))
    return min(max(k, SHIFT_RANGE[0]), SHIFT_RANGE[1])


def _prescaled_forward(original, c: float):
    def forward(x, *args, **kwargs):
        return original(x * c, *args, **kwargs)  # x c: exact in float16 (a power of two)

    return forward


def prescale_norms_(model: nn.Module, profile: RuntimeProfile, samples: list[torch.Tensor]) -> dict[str, NormPrescale]:
    """Give each norm `profile` computes in float16 its measured power-of-two prescale, in place (before export)."""
    norms = prescaled_norms(model, profile)
    peaks = measure_peaks(model, norms, samples)
    done = {}
    for name, m in norms.items():
        if name not in peaks:
            continue  # not run on the samples (another modality's tower): left as it is
        peak, width = peaks[name]
        shift = choose_shift(peak, width)
        if shift == 0:
            continue
        eps_name = _eps_name(m)
        c = 2.0 ** -shift
        setattr(m, eps_name, getattr(m, eps_name) * c * c)  # exact: a power of two
        m.forward = _prescaled_forward(m.forward, c)
        done[name] = NormPrescale(name, peak, width, shift, getattr(m, eps_name))
    return done


def calibration_ids(folder, vocab_size: int, seq_len: int = 64, max_samples: int = 2) -> list[torch.Tensor]:
    """The embedded text, with the folder's tokenizer when it has one."""
    from pathlib import Path

    from ..calibration import make_samples, read_texts
    from ..io.reading import load_tokenizer

    tokenizer = load_tokenizer(Path(folder))  # None without tokenizer files: the text's bytes as ids
    return make_samples(read_texts(None), tokenizer, vocab_size, seq_len, max_samples)


# ----------------------------------------------------------------------------------------------------------------
# The graph a float16 runtime computes: the exporter's float32 casts and constants made float16
# ----------------------------------------------------------------------------------------------------------------


def fp16_statistics(proto, keep_output: str = "logits"):
    """A copy of `proto` with every Cast to float32 a Cast to float16 and every float32 initializer and Constant
    float16, except the final Cast to the float32 output `keep_output`: the norms' statistics (and the rest of the
    modeling code's float32 islands) computed in float16, as the profile says the runtime does."""
    import onnx
    from onnx import TensorProto, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    del graph.value_info[:]

    def half(t):
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype("float16"), t.name))

    for t in graph.initializer:
        half(t)
    for node in graph.node:
        if keep_output in node.output:
            continue
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.FLOAT16
            elif a.type == onnx.AttributeProto.TENSOR:
                half(a.t)
        if any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
            raise HalfsafeError(f"{node.op_type} has a subgraph: fp16_statistics covers flat graphs only")
    for v in list(graph.input) + list(graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT and v.name != keep_output:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return out
