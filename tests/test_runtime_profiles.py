"""Runtime profiles and their float16 emulation: hand-computed cases, real transformers norm modules, tiny models."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_tiny, tiny_ids
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from halfsafe.core import arith16, arith16_webgpu
from halfsafe.engine.precision import cast_copy
from halfsafe.errors import HalfsafeError
from halfsafe.runtime.emulate import emulate_runtime
from halfsafe.runtime.kernels.generic import attention16
from halfsafe.runtime.kernels.ort_webgpu import attention_webgpu16
from halfsafe.runtime.profiles import FP16_STATS, GRAPH_KERNELS, KINDS, PROFILES, SplitK, get_profile, split_groups

pytestmark = pytest.mark.usefixtures("one_thread")
INF = float("inf")


def test_profiles_are_data_and_unknown_names_fail():
    assert set(PROFILES) == {"torch", "fp16-norm-stats", "layernorm-decomposed", "fp16-accumulate", "all-fp16", "ort-webgpu"}
    assert get_profile(None).is_torch and get_profile("torch").is_torch
    assert not any(PROFILES[p].is_torch for p in PROFILES if p != "torch")
    assert PROFILES["all-fp16"].matmul_chunk == 32 and PROFILES["all-fp16"].attention_fp16
    webgpu = PROFILES["ort-webgpu"]
    assert webgpu.matmul_chunk == 1 and webgpu.attention_fp16 and webgpu.kernels == "ort-webgpu"
    assert not webgpu.norm_stats_fp16 and all(PROFILES[p].kernels == "generic" for p in PROFILES if p != "ort-webgpu")
    with pytest.raises(HalfsafeError, match="choose one of torch, fp16-norm-stats"):
        get_profile("webgpu")


def test_every_profile_names_kernels_that_exist():
    """A profile's `kernels` is a module of halfsafe.runtime.kernels, which provides what the emulation calls."""
    from halfsafe.runtime.kernels import KERNELS, kernels_for

    assert {p.kernels for p in PROFILES.values()} <= set(KERNELS)
    for name, module in KERNELS.items():
        assert module.NAME == name and callable(module.attention(PROFILES['all-fp16'])[1])
        assert callable(module.graph_norm_forward) and callable(module.activation_forward)
    with pytest.raises(HalfsafeError, match="no float16 kernels named 'metal'"):
        kernels_for("metal")


def test_profiles_answer_what_they_emulate_measure_and_export():
    """What each profile does is asked of it (runtime.emulate, runtime.stats and the export read the answers)."""
    p = PROFILES
    assert all(p["torch"].norm_arith(rms) is None for rms in (True, False)) and not p["torch"].accumulates_fp16
    assert p["fp16-norm-stats"].norm_arith(True) == FP16_STATS == p["fp16-norm-stats"].norm_arith(False)
    assert p["layernorm-decomposed"].norm_arith(True) is None and p["layernorm-decomposed"].norm_arith(False) == FP16_STATS
    assert p["ort-webgpu"].norm_arith(True) == GRAPH_KERNELS == p["ort-webgpu"].norm_arith(False)
    assert [n for n in p if p[n].norm_stats_in_fp16(True)] == ["fp16-norm-stats", "all-fp16"]
    assert [n for n in p if p[n].norm_stats_in_fp16(False)] == ["fp16-norm-stats", "layernorm-decomposed", "all-fp16"]
    assert [n for n in p if p[n].accumulates_fp16] == ["fp16-accumulate", "all-fp16", "ort-webgpu"]
    assert {n: p[n].attention_kernels for n in p if p[n].attention_kernels} == {"all-fp16": "generic", "ort-webgpu": "ort-webgpu"}
    assert [n for n in p if p[n].graph_activations] == ["ort-webgpu"]
    webgpu = p["ort-webgpu"]
    t, th = webgpu.split_k.bound("linear"), webgpu.split_k.bound("head")
    assert (webgpu.linear_split("linear", 4 * t), webgpu.linear_split("head", 4 * th), webgpu.linear_split("conv1d", 4 * t)) == (4, 4, 1)
    assert all(p[n].linear_split("linear", 4096) == 1 for n in p if n != "ort-webgpu")
    # the export's rewrites, as data
    assert [n for n in p if p[n].prescales_norms] == ["fp16-norm-stats", "layernorm-decomposed", "all-fp16"]
    assert webgpu.onnx_split_k == webgpu.split_k and webgpu.split_k.terms is not None and all(p[n].onnx_split_k is None for n in p if n != "ort-webgpu")
    assert [n for n in p if p[n].splits_head] == ["fp16-accumulate", "all-fp16"]


def test_float16_sums_by_hand():
    assert float(arith16.sum16(torch.tensor([60000.0, 10000.0]))) == INF  # 70000 > 65504
    # 2048 + 1 is a tie between 2048 and 2050; ties go to the even 2048, so adding 1s one at a time never moves it
    assert float(arith16.sum16(torch.tensor([2048.0, 1.0, 1.0]), lanes=1)) == 2048.0
    assert float(torch.tensor([2048.0, 1.0, 1.0]).sum().half()) == 2050.0  # float32 accumulation, rounded once
    # lanes: lane 0 adds 2048 + 1 -> 2048, lane 1 holds 1; the tree adds 2048 + 1 -> 2048 again
    assert float(arith16.sum16(torch.tensor([2048.0, 1.0, 1.0]), lanes=2)) == 2048.0
    assert float(arith16.sum16(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), lanes=4)) == 15.0
    assert float(arith16.mean16(torch.tensor([[3.0, 5.0]]))[0]) == 4.0
    assert float(arith16.sum16(torch.tensor([1.0, 2.0, 3.0]), lanes=3)) == 6.0  # odd lane count: the middle lane waits


def test_squares_in_range_whose_sum_overflows_zero_the_row():
    x = torch.full((1, 8), 100.0)  # each square 10000 fits, their sum 80000 does not: the mean is inf before / 8
    assert float(arith16.rms_inv16(x, 1e-6)) == 0.0
    assert float(torch.rsqrt((x * x).mean(-1))) == pytest.approx(0.01)  # float32 statistics


def test_a_row_whose_squares_overflow_is_zeroed():
    x = torch.zeros(1, 8)
    x[0, 0] = 300.0  # 300^2 = 90000 > 65504: the square is inf, so is the mean, and rsqrt(inf) = 0
    assert float(arith16.rms_inv16(x, 1e-6)) == 0.0
    norm = LlamaRMSNorm(8, eps=1e-6).half()
    with torch.no_grad():
        norm.weight.fill_(1.0)
    h = x.half()
    assert abs(float(norm(h)[0, 0].detach()) - 8 ** 0.5) < 0.01  # PyTorch: fp32 statistics, 300 / (300 / sqrt(8))
    with emulate_runtime(norm, PROFILES["fp16-norm-stats"]):
        out = norm(h)
    assert torch.equal(out, torch.zeros_like(h))  # finite and silently wrong
    assert abs(float(norm(h)[0, 0]) - 8 ** 0.5) < 0.01  # restored


def test_an_eps_that_rounds_to_zero_makes_nan():
    assert arith16.scalar16(3.9e-9) == 0.0 and arith16.scalar16(1e-6) > 0
    assert float(arith16.rms_inv16(torch.zeros(1, 4), 3.9e-9)) == INF
    norm = Gemma3RMSNorm(4, eps=3.9e-9).half()
    zeros = torch.zeros(1, 4, dtype=torch.float16)
    assert torch.equal(norm(zeros), zeros)  # fp32: rsqrt(3.9e-9) is finite, 0 x finite = 0
    with emulate_runtime(norm, PROFILES["fp16-norm-stats"]):
        assert torch.isnan(norm(zeros)).all()  # rsqrt(0) = inf, 0 x inf = NaN


def test_gemma3_norm_in_range_follows_the_hand_formula():
    torch.manual_seed(0)
    norm = Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    norm = norm.half()
    x = (torch.randn(3, 16) * 20).half()
    xf = x.float()
    inv = arith16.r16(torch.rsqrt(arith16.r16(arith16.mean16(arith16.r16(xf * xf)) + arith16.scalar16(1e-6)))).unsqueeze(-1)
    want = ((xf * inv) * (1.0 + norm.weight.float())).half()  # the rest as the modeling code computes it
    with emulate_runtime(norm, PROFILES["fp16-norm-stats"]):
        got = norm(x)
    assert torch.equal(got, want)


def test_a_norm_the_emulation_cannot_follow_is_an_error():
    class OddRMSNorm(nn.Module):
        def forward(self, x):
            return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)

    norm = OddRMSNorm()
    with emulate_runtime(norm, PROFILES["fp16-norm-stats"]), pytest.raises(HalfsafeError, match="OddRMSNorm"):
        norm(torch.ones(1, 4).half())


def test_layernorm_decomposed_pow_overflow_leaves_the_bias():
    ln = nn.LayerNorm(4).half()
    with torch.no_grad():
        ln.bias.copy_(torch.tensor([0.5, -0.5, 0.25, 0.0]))
    x = torch.tensor([[400.0, 0.0, 0.0, 0.0]]).half()  # |x - mean| = 300 > 255.9: Pow overflows
    plain = ln(x)
    assert torch.isfinite(plain).all() and abs(float(plain[0, 0]) - 1.732 - 0.5) < 0.01
    with emulate_runtime(ln, PROFILES["layernorm-decomposed"]):
        out = ln(x)
    assert torch.equal(out, ln.bias.detach()[None])
    with emulate_runtime(ln, PROFILES["fp16-accumulate"]):  # no norm statistics in that profile
        assert torch.equal(ln(x), plain)


def test_linear_partial_sums_overflow_where_the_total_does_not():
    lin = nn.Linear(128, 1, bias=False).half()
    with torch.no_grad():
        lin.weight.copy_(torch.cat([torch.full((64,), 1500.0), torch.full((64,), -1500.0)])[None])
    x = torch.ones(1, 128, dtype=torch.float16)
    assert float(lin(x)) == 0.0  # float32 accumulation: 32 x 1500 x 2 - ... = 0
    with emulate_runtime(lin, PROFILES["fp16-accumulate"]):
        assert float(lin(x)) == INF  # running sum 48000 + 48000 = 96000 -> inf, which no later chunk undoes
    parts = torch.tensor([[2048.0, 1.0, 1.0]])
    assert float(arith16.running16(parts)[0]) == 2048.0


def test_torch_profile_is_no_patch_bit_for_bit():
    model = make_tiny("gemma3_text")
    half = cast_copy(model, torch.float16).eval()
    ids = tiny_ids(model)
    with torch.no_grad():
        plain = half(input_ids=ids).logits
        handle = emulate_runtime(half, PROFILES["torch"])
        assert len(handle) == 0
        with handle:
            assert torch.equal(half(input_ids=ids).logits, plain)
        with emulate_runtime(half, PROFILES["all-fp16"]):
            patched = half(input_ids=ids).logits
        assert not torch.equal(patched, plain) and torch.isfinite(patched).all()
        assert torch.equal(half(input_ids=ids).logits, plain)  # every patch taken off
    assert half.config._attn_implementation == model.config._attn_implementation


@pytest.mark.parametrize("key", ["llama", "gemma3_text", "gpt2", "qwen3"])
def test_every_profile_stays_close_on_small_activations(key):
    model = make_tiny(key)
    half = cast_copy(model, torch.float16).eval()
    ids = tiny_ids(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        plain = float((half(input_ids=ids).logits.float() - ref).abs().max())
        for name in PROFILES:
            with emulate_runtime(half, PROFILES[name]):
                err = float((half(input_ids=ids).logits.float() - ref).abs().max())
            assert err < 4 * plain + 1e-3, (name, err, plain)


def test_ort_webgpu_patches_linears_attention_gelu_and_norms():
    """The ort-webgpu profile on a tiny Gemma 3: every linear a float16 running sum, attention, GELU (tanh) and the
    norms' float32 means as the provider's shaders compute them (tests/test_ort_webgpu_ops.py checks those against
    the runtime itself)."""
    from halfsafe.runtime.emulate import calls

    model = make_tiny("gemma3_text")
    half = cast_copy(model, torch.float16).eval()
    ids = tiny_ids(model)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        plain = half(input_ids=ids).logits
        calls.clear()
        with emulate_runtime(half, PROFILES["ort-webgpu"]):
            patched = half(input_ids=ids).logits
        assert torch.equal(half(input_ids=ids).logits, plain)  # every patch taken off
    assert dict(calls) == {"linear": 7 * layers + 1, "attention": layers, "activation": layers, "norm": 6 * layers + 1}
    assert not torch.equal(patched, plain) and torch.isfinite(patched).all()
    assert half.config._attn_implementation == model.config._attn_implementation


def test_attention_webgpu16_scales_q_and_k_by_the_root_and_sums_in_order():
    torch.manual_seed(0)

    class M:
        head_dim, num_key_value_groups, training = 8, 1, False

    q, k, v = (torch.randn(1, 2, 5, 8).half() for _ in range(3))
    mask = torch.triu(torch.full((5, 5), -65504.0), 1)[None, None].half()
    out, probs = attention_webgpu16(M(), q, k, v, mask, scaling=0.3)
    root = arith16.scalar16(0.3 ** 0.5)
    logits = arith16.sequential_matmul16(arith16.r16(q.float() * root), arith16.r16(k.float() * root))
    want = arith16_webgpu.softmax16(arith16.r16(logits + mask.float()))
    assert torch.equal(probs.float(), want)
    assert torch.equal(out.float().transpose(1, 2), arith16.sequential_matmul16(want, v.float().transpose(-1, -2)))
    assert torch.equal(probs[0, 0, 0, 1:], torch.zeros(4, dtype=torch.float16))  # causal mask held


def test_split_matmul16_adds_the_groups_as_the_export_does():
    torch.manual_seed(0)
    x, w = arith16.r16(torch.randn(3, 64) * 4), arith16.r16(torch.randn(5, 64))
    part = [arith16.sequential_matmul16(x[:, i * 16:(i + 1) * 16], w[:, i * 16:(i + 1) * 16]) for i in range(4)]
    r = arith16.r16
    assert torch.equal(arith16.split_matmul16(x, w, 1, 4), r(r(part[0] + part[2]) + r(part[1] + part[3])))
    assert torch.equal(arith16.split_matmul16(x, w, 1, 4, halves=False), r(r(part[0] + part[1]) + r(part[2] + part[3])))
    assert [split_groups(k, 16) for k in (640, 2048, 100, 7)] == [16, 16, 4, 1]
    rule = SplitK(terms=256)  # Gemma 3 270M's K: q/k/v/gate/up and the head 640, o 1024, down 2048, QK^T 256
    assert [rule.groups_for("linear", k) for k in (640, 1024, 2048, 256)] == [4, 4, 8, 1]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 16), st.integers(1, 4096), st.sampled_from(KINDS))
def test_split_k_terms_is_the_fewest_groups_that_bound_each_running_sum(k, terms, kind):
    """SplitK(terms=T): a power of two dividing K, every group at most T terms where K allows it (else K's odd part,
    a group that cannot be halved), and no fewer groups would do; the same for every kind of product."""
    g = SplitK(terms=terms).groups_for(kind, k)
    assert g >= 1 and g & (g - 1) == 0 and k % g == 0
    assert k // g <= terms or (k // g) % 2 == 1
    assert g == 1 or k // (g // 2) > terms


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 16), st.tuples(*[st.integers(1, 128)] * 3))
def test_split_k_groups_are_each_kinds_count(k, groups):
    rule = SplitK(groups=groups)
    assert [rule.groups_for(kind, k) for kind in KINDS] == [split_groups(k, g) for g in groups]
    assert SplitK.parse(rule.label) == rule and SplitK.parse(SplitK(terms=groups[0]).label) == SplitK(terms=groups[0])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 16), st.tuples(*[st.integers(1, 4096)] * 3))
def test_split_k_bounds_per_kind_are_each_kinds_own_rule(k, bounds):
    """SplitK(terms=(L, H, A)): each kind of product cut as SplitK(terms=its bound) cuts it; written and read back by
    its label; one bound for all three kinds is the single-number rule, equal to it."""
    rule = SplitK(terms=bounds)
    assert [rule.groups_for(kind, k) for kind in KINDS] == [SplitK(terms=b).groups_for(kind, k) for b, kind in zip(bounds, KINDS)]
    assert SplitK.parse(rule.label) == rule and rule.splits
    assert (rule == SplitK(terms=bounds[0])) == (len(set(bounds)) == 1)
    assert rule.to_dict()["terms"] == (bounds[0] if len(set(bounds)) == 1 else list(bounds))


@pytest.mark.parametrize("text", ["", "4", "4,4", "1,2,3,4", "terms:", "terms:0", "terms:-3", "0,4,4", "a,b,c", "terms:2.5",
                                  "terms:64,64", "terms:1,2,3,4", "terms:64,0,64", "terms:64,,64", "terms:a,b,c"])
def test_split_k_parse_refuses_in_one_line(text):
    with pytest.raises(HalfsafeError, match=r"^[^\n]*(give none, terms:N|at least 1)[^\n]*$"):
        SplitK.parse(text)


def test_ort_webgpu_emulates_the_split_k_export():
    """The profile's emulation splits each linear's K (the head's and QK^T's too) as its export does: on a tiny
    Gemma 3 the logits differ from the unsplit emulation's, and from those with QK^T left whole."""
    from dataclasses import replace

    model = make_tiny("gemma3_text")
    half = cast_copy(model, torch.float16).eval()
    ids = tiny_ids(model)
    profile = replace(get_profile("ort-webgpu"), split_k=(16, 16, 16))
    with torch.no_grad():
        with emulate_runtime(half, profile):
            split = half(input_ids=ids).logits
        with emulate_runtime(half, replace(profile, split_k=(16, 16, 1))):
            qk_whole = half(input_ids=ids).logits
        with emulate_runtime(half, replace(profile, split_k=(1, 1, 1))):
            whole = half(input_ids=ids).logits
    assert not torch.equal(split, whole) and not torch.equal(split, qk_whole) and torch.isfinite(split).all()


def test_ort_webgpu_layer_norm_is_the_fused_kernel():
    torch.manual_seed(0)
    norm = nn.LayerNorm(64).half()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = (torch.randn(8, 64) * 3 + 1).half()
    with torch.no_grad():
        plain = norm(x)
        with emulate_runtime(norm, PROFILES["ort-webgpu"]):
            got = norm(x)
    want = arith16_webgpu.layer_norm16(x.float(), norm.weight, norm.bias, norm.eps)
    assert torch.equal(got.float(), want) and not torch.equal(got, plain)  # four float16 roundings, not one


def test_attention16_matches_eager_softmax_attention():
    torch.manual_seed(0)

    class M:
        head_dim, num_key_value_groups, training = 8, 1, False

    q, k, v = (torch.randn(1, 2, 5, 8).half() for _ in range(3))
    mask = torch.triu(torch.full((5, 5), -65504.0), 1)[None, None].half()
    out, probs = attention16(M(), q, k, v, mask)
    logits = (q.float() @ k.float().transpose(2, 3)) * 8 ** -0.5 + mask.float()
    want = torch.softmax(logits, -1) @ v.float()
    assert torch.allclose(out.float(), want.transpose(1, 2), atol=3e-3)
    assert torch.equal(probs[0, 0, 0, 1:], torch.zeros(4, dtype=torch.float16))  # causal mask held


def test_streamed_model_with_every_matrix_wide_emulates_as_the_whole(tmp_path, monkeypatch):
    from tiny import save_tiny

    from halfsafe.core.forward import logits
    from halfsafe.engine import wide
    from halfsafe.engine.precision import in_dtype
    from halfsafe.engine.streamed import streamed_of
    from halfsafe.io.loading import load_model

    monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
    monkeypatch.setattr(wide, "CHUNK_BYTES", 1)
    save_tiny("gemma3_text", tmp_path)
    whole = load_model(tmp_path).model
    streamed = load_model(tmp_path, stream=True).model
    streamed_of(streamed).wide_bytes = 0  # the head and every linear read 32 rows at a time
    ids = tiny_ids(whole, 12)
    with in_dtype(whole, torch.float16) as a, in_dtype(streamed, torch.float16) as b:
        with emulate_runtime(a, PROFILES["all-fp16"]):
            want = logits(a, ids)
        with emulate_runtime(b, PROFILES["all-fp16"]):
            got = logits(b, ids)
    assert torch.equal(want, got)


def test_t5_norms_are_rms_norms_and_every_kind_is_counted():
    from halfsafe.runtime import emulate

    model = make_tiny("mt5")
    half = cast_copy(model, torch.float16).eval()
    ids = tiny_ids(model, 8)
    n_norms = sum(type(m).__name__ == "MT5LayerNorm" for m in half.modules())
    emulate.calls.clear()
    with emulate_runtime(half, PROFILES["fp16-norm-stats"]), torch.no_grad():
        half(input_ids=ids, decoder_input_ids=ids)
    assert n_norms and emulate.calls["norm"] == n_norms and not emulate.calls["linear"]
