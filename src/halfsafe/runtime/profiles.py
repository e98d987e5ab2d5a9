"""Runtime profiles: which intermediate quantities a runtime computes in float16, as data.

halfsafe's checkpoints are made for PyTorch's arithmetic: transformers computes norm statistics in float32 and
matrix products accumulate in float32; only the tensors between ops are float16. Runtimes without bfloat16 compute
more in float16. A profile names exactly what; `halfsafe.runtime.emulate` computes it on CPU (arith16), `scan --runtime`
measures the quantities it puts in float16, `verify --runtime` runs it, `convert --runtime` refuses a checkpoint that
breaks under it. The kernels each profile follows, read at the commits named:

- microsoft/onnxruntime `onnxruntime/contrib_ops/webgpu/quantization/matmul_nbits.wgsl.template` (commit 12e917d):
  line 21 declares `inter_results: array<array<output_element_t, tile_size_k_vec>, tile_size>`, the per-lane
  partial sums in the *output* element type (float16 for a float16 model); each lane's `var sum = output_element_t(0)`
  is a float16 dot product over its run of K (32 values for 4-bit weights in vec4<u32>), added by
  `inter_results[...][idx] += sum` into the running float16 sum across K tiles, and the lanes are summed by
  `output_value += inter_results[local_idx][b]`, float16 again.
- microsoft/onnxruntime `onnxruntime/core/providers/webgpu/reduction/reduction_ops.cc` (commit 076cc6c),
  `ReduceSharedProgram::GenerateShaderCode`: `var bestValue : _A_value_t` (the input's element type) accumulates
  elements k = local_idx, local_idx + workgroup_size, ... and ReduceMean divides by `output_element_t(reduceSize)`:
  a ReduceMean over a float16 `Pow(x, 2)` sums squares in float16 (what `arith16.sum16` emulates).
- The same repository's fused `LayerNormalization` / `SimplifiedLayerNormalization` WebGPU kernel
  (`onnxruntime/core/providers/webgpu/nn/layer_norm.cc`, commit 007a78e) does *not*: `sum_squared_shared` is
  `array<f32, ...>`; only `x_element_t(inv_std_dev)` returns to float16. So the norm-statistics profiles describe
  graphs whose norms are *decomposed* into Pow/ReduceMean/Sqrt/Div ops with float16 inputs (an fp16 conversion that
  also turns the graph's own float32 casts into float16), and on-device engines whose RMSNorm kernels sum squares
  in float16; not ORT WebGPU's fused norm op.
- `ort-webgpu`: ONNX Runtime's WebGPU provider as onnxruntime-node 1.30.0 ships it (its build info: git-commit-id
  f2c39fe2f), the shaders it generates dumped from that binary (session log level verbose prints each one), run on
  Mesa 25.0.7's lavapipe. The generators, read at microsoft/onnxruntime's stored commits: `math/matmul.cc`
  (0099edd): `MatMul::ComputeInternal` runs `MatMulNaiveProgram` when N < 8 and K < 8, else `CreateMatMulProgram`:
  vec4 when K and N are multiples of 4, 4x1 or 4x4 outputs per thread (M <= 8 or not), split-K on four Intel
  architectures only; `math/matmul_packed.cc` (e0432f8), `MakeMatMulPackedVec4Source` / `MakeMatMulPackedSource`:
  tiles of 32 k, and per output one float16 accumulator `var acc: array<vec4<a_element_t>, ...>` taking
  `acc[i] = BCached0 * ACached.x + acc[i]` for k = 0, 1, ... in order (the naive program: `fma(a, b, values[i])`,
  the same order). Lavapipe rounds the product and the sum each to float16, `fma()` included (measured: no fused
  rounding, subnormals kept): a plain float16 running sum of rounded products, `matmul_chunk=1`, on every path.
  `math/softmax.cc` in the binary is an online softmax (the stored 04488b7 is the older two-pass one; the dumped
  shader is what arith16_webgpu.softmax16 follows), and `Gelu[tanh]` computes tanh from `exp` in float16; WGSL `exp`
  of float16 is exp2 of a float16 product on lavapipe (arith16_webgpu). `nn/layer_norm.cc`'s fused
  LayerNormalization: float32 sums, then `(x - mean) * inv_std * scale + bias` in float16; `reduction_ops.cc`'s
  ReduceMean of float32 (the RMSNorm statistic of Gemma and Llama, which cast to float32): 64 strided lanes, then
  a halving tree. The exported graphs hold what remains: attention as torch.onnx decomposes SDPA (q and k each
  scaled by sqrt(scale) in float16, MatMul, Add mask, Softmax, MatMul), and what ONNX Runtime's optimizer fuses
  them into (SiLU's Sigmoid and Mul: QuickGelu; gelu_new: FastGelu; Add and LayerNormalization: SkipLayerNorm,
  the same arithmetic). Measured: the plain export of Gemma 3 270M (`--split-k none`) on the runtime and this profile's emulation
  give the same logits bit for bit (48 tokens, all 262144 per token), as do tiny Gemma 3, Llama and GPT-2 exports.
  `split_k` is emulated too (arith16.split_matmul16; QK^T in kernels.ort_webgpu): the profile computes what
  `export onnx` writes for the same SplitK, measured bit for bit on Gemma 3 270M with linears and head split in 16
  (KL 1.41e-4 against 1.93e-3 unsplit, 48 tokens) and on tiny models under group counts and bounds on the terms
  (tests); the plain export is `dataclasses.replace(profile, split_k=SplitK())`. transformers.js numbers Gemma 3's
  positions from 1 (its decoder_forward's start_index, for paligemma and gemma3): RoPE makes that the same function,
  not the same roundings, so its logits are the emulation's bit for bit when the emulated model is given the same
  position_ids (measured: the real 270M under the default split, 48 tokens, every logit equal).
  The rule, SplitK(terms=(64, 64, 128)): each product's K in the fewest power-of-two groups of at most 64 terms per
  float16 running sum for the linears and the head, 128 for QK^T (Gemma 3 270M: q, k, v, gate, up and the head 640
  in 16 groups of 40, o 1024 in 16, down 2048 in 32, QK^T 256 in 2), chosen per kind from the emulated curve on
  Gemma 3 270M (128 held-out tokens, KL to fp32, positions from 0 and from 1; bf16's 9.23e-4 and 9.44e-4): a bound
  of 64 everywhere 8.91e-5 and 8.35e-5; the linears at 128 1.04e-4 and 1.08e-4 (not 10x below bf16), the head at
  128 (8 groups of 80) 1.15e-4 (48 tokens), the head whole 1.30e-3 (48 tokens, worse than bf16); QK^T at 128
  8.96e-5 and 7.92e-5, whole 1.62e-4 (48 tokens). So the linears and the head need 64, QK^T 128, and nothing
  shorter than its bound is split. It is also what `export onnx` writes by default (export_profile): a provider
  that sums in float32 computes the split graph as the plain one, up to float16 roundings of the partials.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import HalfsafeError

DEFAULT = "torch"
GENERIC = "generic"  # kernels: the float16 arithmetic of runtime.emulate's own ops (arith16)
FP16_STATS, GRAPH_KERNELS = "fp16-stats", "graph"  # RuntimeProfile.norm_arith


KINDS = ("linear", "head", "attention")  # the products split-K cuts: a weight as B, the logits', QK^T


@dataclass(frozen=True)
class SplitK:
    """How split-K (halfsafe.export.onnx_split_k) cuts each matrix product's K, one rule for the graph and its
    emulation: `terms`, the fewest groups (a power of two dividing K) that keep every float16 running sum at most
    that many terms, one bound for every product or one per kind (linear, head, attention), so a product whose K is
    that short stays whole; or, `terms` None, `groups`, a count per kind (linear, head, attention), each product's
    the largest power of two at most that which divides its K. A bound the same for all three kinds is kept as one
    number (SplitK(terms=(64, 64, 64)) == SplitK(terms=64))."""

    terms: int | tuple[int, int, int] | None = None
    groups: tuple[int, int, int] = (1, 1, 1)

    def __post_init__(self) -> None:
        terms = self.terms
        bounds = terms if isinstance(terms, tuple) else (terms,) if terms is not None else ()
        if isinstance(terms, tuple) and len(terms) != 3 or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in bounds):
            raise HalfsafeError(f"split-K terms {terms!r:.60}: give a whole number of at least 1, or three "
                                "(linears, head, QK^T)")
        if isinstance(terms, tuple) and len(set(terms)) == 1:
            object.__setattr__(self, "terms", terms[0])
        if len(self.groups) != 3 or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in self.groups):
            raise HalfsafeError(f"split-K groups {self.groups!r:.60}: give three whole numbers of at least 1 "
                                "(linears, head, attention)")

    def bound(self, kind: str) -> int | None:
        """The most terms per float16 running sum for products of `kind` (None: the rule counts groups)."""
        if isinstance(self.terms, tuple):
            return self.terms[KINDS.index(kind)]
        return self.terms

    def groups_for(self, kind: str, k: int) -> int:
        """How many groups this product's K is cut into (1: left whole); `kind` one of KINDS."""
        bound = self.bound(kind)
        if bound is None:
            return split_groups(k, self.groups[KINDS.index(kind)])
        g = 1
        while k // g > bound and k % (2 * g) == 0:
            g *= 2
        return g

    @property
    def splits(self) -> bool:
        return self.terms is not None or max(self.groups) > 1

    @property
    def label(self) -> str:
        """As `--split-k` takes it (SplitK.parse)."""
        if self.terms is not None:
            return "terms:" + (",".join(map(str, self.terms)) if isinstance(self.terms, tuple) else str(self.terms))
        return ",".join(map(str, self.groups)) if self.splits else "none"

    @classmethod
    def parse(cls, text: str) -> "SplitK":
        """`--split-k`: `none`, `terms:N`, `terms:L,H,A` (at most N terms per running sum, or one bound for the
        linears, the head and QK^T) or `L,H,A` (groups for the linears, the head and QK^T)."""
        hint = ("give none, terms:N (at most N terms per float16 running sum), terms:L,H,A (a bound each for linears, "
                "head, QK^T) or L,H,A (groups for linears, head, QK^T)")
        text = text.strip()
        if text == "none":
            return cls()
        try:
            numbers = tuple(int(g) for g in text.removeprefix("terms:").split(","))
        except ValueError:
            raise HalfsafeError(f"--split-k {text!r:.60}: {hint}") from None
        if text.startswith("terms:") and len(numbers) in (1, 3):
            return cls(terms=numbers[0] if len(numbers) == 1 else numbers)
        if len(numbers) != 3 or text.startswith("terms:"):
            raise HalfsafeError(f"--split-k {text!r:.60}: {hint}")
        return cls(groups=numbers)

    def to_dict(self) -> dict:
        return {"terms": list(self.terms) if isinstance(self.terms, tuple) else self.terms, "groups": list(self.groups)}


def split_groups(k: int, asked: int) -> int:
    """The largest power of two <= `asked` dividing k (1: no split)."""
    g = 1
    while g * 2 <= asked and k % (g * 2) == 0:
        g *= 2
    return g


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    summary: str
    rms_stats_fp16: bool = False  # RMSNorm-type norms: x^2, its mean, + eps and rsqrt in float16
    layernorm_fp16: bool = False  # LayerNorm: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add in float16
    matmul_chunk: int | None = None  # linear layers: dot products of runs of this many k rounded to fp16, summed in fp16
    # (1: each product rounded, then added: a plain float16 running sum)
    attention_fp16: bool = False  # QK^T (accumulated as the linears), scale, mask, softmax and PV in float16
    lanes: int = 64  # float16 reductions: this many strided running sums, then a pairwise tree (reduction_ops.cc)
    # `export onnx --runtime P`: split-K of the graph's products (linears, head, attention QK^T), a SplitK (a tuple
    # (linear, head, attention) of group counts is taken as SplitK(groups=...)): halfsafe.export.onnx_split_k, for
    # runtimes whose MatMul keeps one float16 running sum over K; the emulation splits the linears, the head and QK^T alike
    split_k: "SplitK | tuple[int, int, int]" = (1, 1, 1)
    kernels: str = GENERIC  # "ort-webgpu": softmax, GELU (tanh), norms and attention's scaling as arith16_webgpu

    @property
    def is_torch(self) -> bool:
        """Computes what PyTorch computes: nothing to emulate."""
        return not (self.rms_stats_fp16 or self.layernorm_fp16 or self.matmul_chunk or self.attention_fp16)

    @property
    def norm_stats_fp16(self) -> bool:
        return self.rms_stats_fp16 or self.layernorm_fp16

    # -- what the profile does, asked by the emulation (runtime.emulate), the scan (runtime.stats) and the export --

    def norm_arith(self, rms: bool) -> str | None:
        """How a norm (RMSNorm-type when `rms`, else nn.LayerNorm) computes under this profile: FP16_STATS (its
        statistic in float16), GRAPH_KERNELS (as the profile's graph kernels run the exported norm ops) or None
        (PyTorch's). A profile with float16 norm statistics leaves the other kind of norm to PyTorch."""
        if self.norm_stats_fp16:
            return FP16_STATS if (self.rms_stats_fp16 if rms else self.layernorm_fp16) else None
        return GRAPH_KERNELS if self.kernels != GENERIC else None

    def norm_stats_in_fp16(self, rms: bool) -> bool:
        """Whether a norm's statistic is float16 here: emulated so, and measured by `scan --runtime`."""
        return self.norm_arith(rms) == FP16_STATS

    @property
    def accumulates_fp16(self) -> bool:
        """Linear layers sum their products in float16 (runs of `matmul_chunk`): emulated, and measured by the scan."""
        return bool(self.matmul_chunk)

    def __post_init__(self) -> None:
        if not isinstance(self.split_k, SplitK):
            object.__setattr__(self, "split_k", SplitK(groups=tuple(self.split_k)))

    def linear_split(self, kind: str, k: int) -> int:
        """Groups the emulation cuts a product's K into, as the export's split-K writes it: `kind` "linear" (an
        nn.Linear), "head" (the output embedding) or anything else (GPT-2's Conv1D: a Gemm the export leaves whole)."""
        return self.split_k.groups_for(kind, k) if kind in ("linear", "head") else 1

    @property
    def attention_kernels(self) -> str | None:
        """Which float16 attention the emulation registers (its kernel module's ATTENTION, halfsafe.runtime.kernels), None: PyTorch's."""
        return self.kernels if self.attention_fp16 else None

    @property
    def graph_activations(self) -> bool:
        """Activation modules compute as the profile's graph kernels run the exported activation ops."""
        return self.kernels != GENERIC

    # -- what `export onnx --runtime P` rewrites, as data the exporter reads --

    @property
    def prescales_norms(self) -> bool:
        """The export prescales each norm whose statistic is float16 (halfsafe.export.onnx_norms)."""
        return self.norm_stats_fp16

    @property
    def onnx_split_k(self) -> "SplitK | None":
        """How the export splits each product's K (linears, head, attention QK^T); None: no split-K."""
        return self.split_k if self.split_k.splits else None

    @property
    def splits_head(self) -> bool:
        """The export splits the head's K for float16 accumulation (onnx_accumulate): linears accumulate in float16
        and the graph is not split-K already."""
        return self.accumulates_fp16 and self.onnx_split_k is None

    def without_norm_stats(self) -> "RuntimeProfile":
        """What a checkpoint must survive when its graph export computes the norms on a prescaled input
        (`convert --to onnx --runtime P`): P's other float16 arithmetic; the torch profile when nothing is left."""
        if not self.norm_stats_fp16:
            return self
        rest = replace(self, name=f"{self.name} (norms in the graph)", rms_stats_fp16=False, layernorm_fp16=False)
        return PROFILES[DEFAULT] if rest.is_torch else rest

    def to_dict(self) -> dict:
        return {"name": self.name, "summary": self.summary, "rms_stats_fp16": self.rms_stats_fp16,
                "layernorm_fp16": self.layernorm_fp16, "matmul_chunk": self.matmul_chunk,
                "attention_fp16": self.attention_fp16, "lanes": self.lanes, "split_k": self.split_k.to_dict(),
                "kernels": self.kernels}


PROFILES = {p.name: p for p in (
    RuntimeProfile("torch", "PyTorch / transformers: norm statistics and matmul sums in float32 (today's guarantee)"),
    RuntimeProfile("fp16-norm-stats", "norm statistics in float16: RMSNorm's x^2, mean, + eps, rsqrt; LayerNorm "
                   "decomposed (ReduceMean, Sub, Pow, ...) in float16", rms_stats_fp16=True, layernorm_fp16=True),
    RuntimeProfile("layernorm-decomposed", "LayerNorm only, decomposed into float16 ReduceMean, Sub, Pow, ReduceMean, "
                   "Add, Sqrt, Div (Whisper on WebGPU); RMSNorm as PyTorch", layernorm_fp16=True),
    RuntimeProfile("fp16-accumulate", "linear layers accumulate in float16: runs of 32 products, running float16 sum "
                   "(ONNX Runtime WebGPU MatMulNBits)", matmul_chunk=32),
    RuntimeProfile("all-fp16", "fp16-norm-stats and fp16-accumulate, plus attention logits, softmax and PV in float16",
                   rms_stats_fp16=True, layernorm_fp16=True, matmul_chunk=32, attention_fp16=True),
    RuntimeProfile("ort-webgpu", "ONNX Runtime's WebGPU provider (transformers.js device 'webgpu', onnxruntime-node "
                   "1.30, measured on lavapipe): MatMul a float16 running sum of rounded products; attention, softmax, "
                   "GELU and norms as its shaders compute them. The export splits each product's K into groups of at "
                   "most 64 terms (linears, head) or 128 (QK^T), added pairwise", matmul_chunk=1, attention_fp16=True,
                   kernels="ort-webgpu", split_k=SplitK(terms=(64, 64, 128))),
)}


def export_profile(profile: RuntimeProfile, split: SplitK | None = None) -> RuntimeProfile:
    """The profile an ONNX export writes its graph for: `profile` with its products split as `split` says (None: its
    own split-K, or, for the torch profile, ort-webgpu's, since the export's float16 runtime is transformers.js on
    WebGPU, and a provider that sums in float32 computes a split product as it does the whole one)."""
    if split is not None:
        return replace(profile, split_k=split)
    if profile.name == DEFAULT and not profile.split_k.splits:
        return replace(profile, split_k=PROFILES["ort-webgpu"].split_k)
    return profile


def get_profile(name: "str | RuntimeProfile | None") -> RuntimeProfile:
    """The profile named `name` (None: torch); a one-line error listing the profiles otherwise."""
    if isinstance(name, RuntimeProfile):
        return name
    profile = PROFILES.get(name or DEFAULT)
    if profile is None:
        raise HalfsafeError(f"unknown runtime profile {name!r}: choose one of {', '.join(PROFILES)}")
    return profile
