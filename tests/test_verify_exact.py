"""The verify package's parts on hand-made inputs, expected values worked out by hand: the report's dataclasses,
JSON form and markdown table, the environment record, the variants table, the memory counters, the block peaks,
the variant selection and patching, the plots' data, the reference cache and one Runner pass."""

from __future__ import annotations

import math
import os
import platform
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from tiny import make_tiny
from torch import nn

import halfsafe
import halfsafe.plots
from halfsafe.core.weights import compute_device
from halfsafe.engine import fp16_arith, precision
from halfsafe.engine.reads import Reads
from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import HalfsafeError
from halfsafe.runtime.baselines import RuntimeHandle, clamp_residual_adds, keep_residual_fp32
from halfsafe.verify import accumulator, compare, converted, report, runner
from halfsafe.verify.accumulator import Accumulator, matched_prefix, nll_sum
from halfsafe.verify.block_peaks import BlockPeaks
from halfsafe.verify.memory import LiveTensorBytes, parameter_bytes, peak_memory, storage_key
from halfsafe.verify.plots import write_plots
from halfsafe.verify.report import Metrics, VariantResult, VerifyReport, environment, markdown_table
from halfsafe.verify.variants import (
    ALL_VARIANTS,
    BASELINES,
    BF16,
    CLAMP,
    CONVERTED,
    FP16,
    FP32_RESIDUAL,
    HALFSAFE,
    HALFSAFE_FP32_RESIDUAL,
    REFERENCE,
    VARIANTS,
    Variant,
    plain,
)

# --- report: dataclasses and JSON ----------------------------------------------------------------------------------


def test_metrics_greedy_fraction_and_dict():
    assert Metrics().greedy_fraction is None
    assert Metrics(greedy_matched=0, greedy_total=0).greedy_fraction is None
    assert Metrics(greedy_matched=3, greedy_total=4).greedy_fraction == 0.75
    m = Metrics(5, 1, 1, 0.5, 0.8, 3.0, 2.0, 3, 4)
    assert m.to_dict() == {"positions": 5, "nonfinite_logits": 1, "nonfinite_positions": 1, "kl_mean": 0.5, "top1": 0.8,
                           "perplexity": 3.0, "max_abs_logit_error": 2.0, "greedy_matched": 3, "greedy_total": 4,
                           "greedy_fraction": 0.75}
    assert Metrics().to_dict() == {"positions": 0, "nonfinite_logits": 0, "nonfinite_positions": 0, "kl_mean": 0.0, "top1": 0.0,
                                   "perplexity": None, "max_abs_logit_error": 0.0, "greedy_matched": None, "greedy_total": None,
                                   "greedy_fraction": None}


def _result(name: str, overall: Metrics, params: int = 100, peak: int = 50, seconds: float = 2.0) -> VariantResult:
    return VariantResult(VARIANTS[name], overall, [overall], params, peak, "counted", [1.0, 2.0], [[1, 2]], seconds, 10)


def test_variant_result_and_report_dicts():
    m = Metrics(positions=4)
    r = _result(FP16, m, seconds=4.0)
    assert r.name == FP16 and r.forward_tokens_per_s == 2.5
    assert math.isnan(_result(FP16, m, seconds=0.0).forward_tokens_per_s)
    assert r.to_dict() == {
        "name": FP16, "dtype": "float16", "custom_runtime": False, "converted": False, "description": "the original cast to float16",
        "overall": m.to_dict(), "per_text": [m.to_dict()], "parameter_bytes": 100, "peak_activation_bytes": 50,
        "memory_method": "counted", "layer_peaks": [1.0, 2.0], "greedy_tokens": [[1, 2]], "forward_seconds": 4.0,
        "forward_tokens_per_s": 2.5,
    }
    rep = VerifyReport("m", None, "llama", [{"name": "t", "samples": 1, "tokens": 4}], 8, 2, 3, ["l0"],
                       [_result(REFERENCE, m), r], {HALFSAFE: "why"}, {"cpu": "x"})
    assert rep.result(FP16) is r and rep.result(REFERENCE) is rep.results[0]
    with pytest.raises(KeyError, match=r"no variant 'bf16' in this report \(have: fp32, fp16\)"):
        rep.result(BF16)
    assert rep.to_dict() == {
        "model": "m", "converted": None, "model_type": "llama", "texts": [{"name": "t", "samples": 1, "tokens": 4}], "seq_len": 8,
        "greedy_tokens": 2, "prompt_tokens": 3, "reference": "fp32", "fp16_max": 65504.0, "layers": ["l0"],
        "variants": [rep.results[0].to_dict(), r.to_dict()], "skipped": {HALFSAFE: "why"}, "environment": {"cpu": "x"}, "phases": [],
    }
    bare = VerifyReport("m", "c", "t", [], 1, 0, 0, [], [])
    assert bare.skipped == {} and bare.environment == {}


def test_environment_records_versions_and_the_device(monkeypatch):
    env = environment()
    assert env == {"halfsafe": halfsafe.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version(), "platform": platform.platform(), "cpu": report._cpu_name(),
                   "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu"}
    assert environment(torch.device("cpu"))["device"] == "cpu" and "gpu" not in environment(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"GPU of {d}")
    cuda = environment(torch.device("cuda", 1))
    assert cuda["device"] == "cuda:1" and cuda["gpu"] == "GPU of cuda:1"


def test_cpu_name_from_cpuinfo_else_the_platform(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(report, "Path", lambda p: info if p == "/proc/cpuinfo" else Path(p))
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t:  Fancy CPU: 9 cores  \nmodel name\t: second\n")
    assert report._cpu_name() == "Fancy CPU: 9 cores"
    monkeypatch.setattr(platform, "processor", lambda: "proc")
    monkeypatch.setattr(platform, "machine", lambda: "mach")
    info.write_text("processor\t: 0\nthe model name: no\n")
    assert report._cpu_name() == "proc"
    info.unlink()  # unreadable: the platform's name
    assert report._cpu_name() == "proc"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert report._cpu_name() == "mach"


def test_markdown_table_by_hand():
    nan = math.nan
    ref = _result(REFERENCE, Metrics(10, 0, 0, 0.0, 1.0, 12.3456, 0.0, 4, 4), params=2**20, peak=2**20 - 1)
    fp16 = _result(FP16, Metrics(10, 12345, 3, nan, 0.5, math.inf, math.inf, None, None), params=3 * 2**20, peak=1536)
    conv = _result(HALFSAFE_FP32_RESIDUAL, Metrics(10, 0, 0, 1.234e-5, 0.98765, None, 0.01234, 3, 4), params=5 * 2**30, peak=1)
    rep = VerifyReport("m", None, "llama", [], 8, 2, 3, [], [ref, fp16, conv])
    assert markdown_table(rep) == (
        "| variant | custom runtime code | non-finite logits | KL(fp32 ‖ variant) per token | top-1 agreement | perplexity "
        "| greedy tokens = fp32 | max abs logit error | weights | peak activations |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| fp32 | no | 0 | 0 (reference) | - | 12.346 | 4/4 | 0 | 1 MiB | 1,024.0 KiB |\n"
        "| fp16 | no | 12,345 | NaN | 50.00% | inf | - | inf | 3 MiB | 1.5 KiB |\n"
        "| halfsafe fp16 + fp32 residual | yes | 0 | 1.23e-05 | 98.77% | - | 3/4 | 0.0123 | 5,120 MiB | 0.0 KiB |\n"
    )


# --- variants -------------------------------------------------------------------------------------------------------


def test_variants_table():
    assert ALL_VARIANTS == ("fp32", "bf16", "fp16", "fp16 clamp", "fp16 + fp32 residual", "halfsafe fp16",
                            "halfsafe fp16 + fp32 residual")
    assert BASELINES == ALL_VARIANTS[1:5] and CONVERTED == ALL_VARIANTS[5:] and REFERENCE == ALL_VARIANTS[0]
    assert (BF16, FP16, CLAMP, FP32_RESIDUAL, HALFSAFE, HALFSAFE_FP32_RESIDUAL) == ALL_VARIANTS[1:]
    assert list(VARIANTS) == list(ALL_VARIANTS) and all(VARIANTS[k].name == k for k in VARIANTS)
    rows = {k: (v.dtype, v.torch_dtype, v.converted, v.patch, v.custom_runtime) for k, v in VARIANTS.items()}
    assert rows == {
        "fp32": ("float32", torch.float32, False, plain, False),
        "bf16": ("bfloat16", torch.bfloat16, False, plain, False),
        "fp16": ("float16", torch.float16, False, plain, False),
        "fp16 clamp": ("float16", torch.float16, False, clamp_residual_adds, True),
        "fp16 + fp32 residual": ("float16", torch.float16, False, keep_residual_fp32, True),
        "halfsafe fp16": ("float16", torch.float16, True, plain, False),
        "halfsafe fp16 + fp32 residual": ("float16", torch.float16, True, keep_residual_fp32, True),
    }
    assert VARIANTS[CLAMP].description == "float16, each residual add clamped to +-32752 (fp16 ONNX exports of Gemma 3)"
    assert VARIANTS[HALFSAFE].to_dict() == {"name": "halfsafe fp16", "dtype": "float16", "custom_runtime": False, "converted": True,
                                            "description": "the halfsafe-converted checkpoint in float16"}
    assert Variant("x", "float16", False, "d").patch is plain
    handle = plain(nn.Linear(1, 1))
    assert isinstance(handle, RuntimeHandle) and handle._undo == []


# --- memory ---------------------------------------------------------------------------------------------------------


def test_live_tensor_bytes_counts_new_storages_once_until_they_die():
    outside = torch.ones(100)
    with LiveTensorBytes() as t:
        a = torch.ones(1000)  # 4000 bytes
        assert (t.current, t.peak) == (4000, 4000)
        view = a[:10]  # a view: no new memory
        a.add_(1)  # in place: the same memory
        v2 = outside.view(10, 10)  # a view of memory made outside: not counted
        assert (t.current, t.peak) == (4000, 4000)
        b = a * 2  # 4000 more
        assert (t.current, t.peak) == (8000, 8000)
        del b
        assert t.current == 4000
        c = torch.ones(250)  # 1000: under the peak
        assert (t.current, t.peak) == (5000, 8000)
        del a
        assert t.current == 5000  # the view keeps a's memory alive
        del view
        assert t.current == 1000 and t.peak == 8000
        del c, v2
        assert t.current == 0 and t.live == {}
        d = torch.ones(10)  # 40 bytes, and an alias of them that does not keep `d` itself alive
        alias = d.detach()
        assert t.live[storage_key(d)] == [40, 2]
        del d
        assert t.current == 40  # the alias still holds the memory
        del alias
        assert t.current == 0 and t.live == {}
    t._release(12345)  # a storage it never saw: nothing happens
    assert t.current == 0


def test_storage_key_and_parameter_bytes():
    x = torch.ones(4)
    assert storage_key(x) == storage_key(x[1:]) == x.untyped_storage().data_ptr()
    assert storage_key(torch.ones(0)) is None
    assert storage_key(torch.ones(3).to_sparse()) is None
    lin = nn.Linear(4, 3)  # 12 + 3 floats
    assert parameter_bytes(lin) == 60
    tied = nn.Module()
    tied.a, tied.b = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False)
    tied.b.weight = tied.a.weight  # one storage
    tied.register_buffer("buf", torch.zeros(5, dtype=torch.float16))  # 10 bytes
    assert parameter_bytes(tied) == 48 + 10
    shared = nn.Module()
    shared.a, shared.b = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False)
    shared.b.weight = nn.Parameter(shared.a.weight.detach())  # another Parameter, the same memory
    assert len(list(shared.parameters())) == 2 and parameter_bytes(shared) == 48


def test_peak_memory_on_cpu_and_cuda(monkeypatch):
    def run():
        a = torch.ones(100)  # 400 bytes, alive while the sum (4 bytes) is made
        return a.sum()

    out, peak, method = peak_memory(run, torch.device("cpu"))
    assert float(out) == 100.0 and peak == 404 and method == "live tensor bytes (dispatch-level tracking)"
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("sync", d)))
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 1000 if d == dev else -(10**9))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 1350 if d == dev else 10**9)
    out, peak, method = peak_memory(lambda: calls.append(("run",)) or "OUT", dev)
    assert (out, peak, method) == ("OUT", 350, "torch.cuda.max_memory_allocated")
    assert calls == [("sync", dev), ("reset", dev), ("run",), ("sync", dev)]


# --- block peaks ----------------------------------------------------------------------------------------------------


class _Pair(nn.Module):
    def forward(self, x):
        return x * 2, "extra"  # (hidden state, ...) as transformers blocks return


class _Plain(nn.Module):
    def forward(self, x):
        return x + 1


class _Ints(nn.Module):
    def forward(self, x):
        return x.long()


class _Empty(nn.Module):
    def forward(self, x):
        return x[:0]


def test_block_peaks_by_hand():
    model = nn.Module()
    model.a, model.b, model.c, model.e = _Pair(), _Plain(), _Ints(), _Empty()
    peaks = BlockPeaks(model, ["a", "missing", "b", "c", "e"])
    assert peaks.peaks == [0.0] * 5 and len(peaks.handles) == 4
    model.a(torch.tensor([-3.0, 1.0]))  # |x*2| max 6
    model.a(torch.tensor([1.0, 1.0]))  # 2: the max stays 6
    model.b(torch.tensor([-5.0, 2.0]))  # |x+1| max 4
    model.c(torch.tensor([-100.0]))  # integers: not a hidden state
    model.e(torch.tensor([100.0]))  # empty
    assert peaks.peaks == [6.0, 0.0, 4.0, 0.0, 0.0]
    model.b(torch.tensor([math.nan]))
    assert peaks.peaks[2] == math.inf
    model.b(torch.tensor([1.0]))  # once non-finite, stays so
    model.a(torch.tensor([-math.inf]))
    assert peaks.peaks == [math.inf, 0.0, math.inf, 0.0, 0.0]
    peaks.remove()
    fresh = BlockPeaks(model, ["b"])
    model.b(torch.tensor([7.0]))
    assert peaks.peaks[0] == math.inf and fresh.peaks == [8.0]  # removed hooks see nothing
    fresh.remove()
    model.b(torch.tensor([100.0]))
    assert fresh.peaks == [8.0]


# --- compare: which variants, patches, builds -----------------------------------------------------------------------


def test_chosen_variants_and_why_some_are_skipped():
    chosen = compare._chosen
    assert chosen(None, True) == ([VARIANTS[v] for v in ALL_VARIANTS[1:]], {})
    assert chosen(None, False) == ([VARIANTS[v] for v in BASELINES], {})  # not asked by name: not listed
    assert chosen([HALFSAFE, FP16, REFERENCE], False) == ([VARIANTS[FP16]], {HALFSAFE: "no converted checkpoint given"})
    assert chosen([HALFSAFE_FP32_RESIDUAL, HALFSAFE], False) == ([], {HALFSAFE_FP32_RESIDUAL: "no converted checkpoint given",
                                                                       HALFSAFE: "no converted checkpoint given"})
    assert chosen([CLAMP, HALFSAFE, BF16], True) == ([VARIANTS[BF16], VARIANTS[CLAMP], VARIANTS[HALFSAFE]], {})  # in order
    assert chosen([REFERENCE], True) == ([], {})
    with pytest.raises(HalfsafeError, match="^unknown variant\\(s\\) bogus, nope: choose from fp32, bf16, fp16, fp16 clamp, "
                       "fp16 \\+ fp32 residual, halfsafe fp16, halfsafe fp16 \\+ fp32 residual$"):
        chosen([FP16, "bogus", "nope"], True)


def test_run_patched_runs_inside_the_patch_or_records_why_not():
    log = []

    class Patch:
        def __init__(self, model):
            log.append(("patch", model))

        def __enter__(self):
            log.append("on")

        def __exit__(self, *exc):
            log.append("off")

    fake_runner = SimpleNamespace(run=lambda model, variant: log.append(("run", model, variant.name)) or f"result {variant.name}")
    results, skipped = [], {}
    compare._run_patched(fake_runner, "M", Variant("p", "float16", False, "d", Patch), results, skipped)
    assert results == ["result p"] and skipped == {}
    assert log == [("patch", "M"), "on", ("run", "M", "p"), "off"]

    def refuse(model):
        raise HalfsafeError("does not apply here")

    compare._run_patched(fake_runner, "M", Variant("q", "float16", False, "d", refuse), results, skipped)
    assert results == ["result p"] and skipped == {"q": "does not apply here"}


def test_built_casts_the_original_or_takes_the_converted(monkeypatch):
    original = make_tiny("llama")
    said = []
    with compare._built(original, None, False, torch.float16, True, "DEV", said.append) as half:
        assert half is not original and not half.training and said == []
        assert all(p.dtype == torch.float16 for p in half.parameters())
        assert next(original.parameters()).dtype == torch.float32
    with compare._built(original, half, True, torch.float16, True, "DEV", said.append) as same:
        assert same is half  # already float16: as it is
    assert said == ["loading the converted checkpoint"]
    with compare._built(original, half, True, torch.bfloat16, True, "DEV", said.append) as bf:
        assert bf is not half and not bf.training and all(p.dtype == torch.bfloat16 for p in bf.parameters())
    monkeypatch.setattr(compare, "load_converted", lambda c, o, **k: ("loaded", c, o, k))
    with compare._built(original, "folder", True, torch.float16, False, "DEV", said.append) as got:
        assert got == ("loaded", "folder", original, {"stream": False, "device": "DEV"})
    with compare._built(original, "folder", True, torch.float16, True, "DEV2", said.append) as got:
        assert got == ("loaded", "folder", original, {"stream": True, "device": "DEV2"})
    assert said == ["loading the converted checkpoint"] * 4


def test_built_switches_a_streamed_original_and_restores_it(monkeypatch):
    """A streamed original is not copied: it loads its units in the group's dtype for the duration, restored
    after, also when the group fails."""
    log = []
    fake = SimpleNamespace(set_dtype=lambda d: log.append(("set", d)) or "SAVED", restore_dtype=lambda s: log.append(("restore", s)))
    original = SimpleNamespace()
    monkeypatch.setattr(precision, "streamed_of", lambda m: fake if m is original else None)
    monkeypatch.setattr(precision, "cast_copy", lambda *a: pytest.fail("a streamed original is not copied"))
    said = []
    with compare._built(original, None, False, torch.bfloat16, True, "DEV", said.append) as got:
        assert got is original and log == [("set", torch.bfloat16)]
    assert log == [("set", torch.bfloat16), ("restore", "SAVED")] and said == []
    log.clear()
    with pytest.raises(RuntimeError, match="^boom$"):
        with compare._built(original, None, False, torch.float16, True, "DEV", said.append):
            raise RuntimeError("boom")
    assert log == [("set", torch.float16), ("restore", "SAVED")]


# --- converted folders ----------------------------------------------------------------------------------------------


def test_check_converted_names_the_problem(tmp_path):
    original = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
    with pytest.raises(HalfsafeError, match="^converted checkpoint .*nope is not a folder: give the output folder of `halfsafe convert`$"):
        converted.check_converted(tmp_path / "nope", original)
    folder = tmp_path / "gpt2"
    transformers.GPT2Config().save_pretrained(folder)
    with pytest.raises(HalfsafeError, match="is a 'gpt2' model but the original is 'llama': give the checkpoint converted from this model"):
        converted.check_converted(folder, original)
    with pytest.raises(HalfsafeError, match="could not load the converted checkpoint"):  # a config and no weights
        converted.load_converted(folder, SimpleNamespace(config=SimpleNamespace(model_type="gpt2")), device="cpu")
    with pytest.raises(HalfsafeError, match="^.*gpt2 has no weights \\(\\*\\.safetensors\\): copy the weight files next to config.json$"):
        converted.load_converted(folder, SimpleNamespace(config=SimpleNamespace(model_type="gpt2")), stream=True, device="cpu")


def test_load_converted_says_why_loading_failed_in_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "gpt2"
    transformers.GPT2Config().save_pretrained(folder)

    def fail(*a, **k):
        raise ValueError("x" * 250 + "\nsecond line")

    monkeypatch.setattr(converted, "load_pure_fp16", fail)
    with pytest.raises(HalfsafeError) as e:
        converted.load_converted(folder, SimpleNamespace(config=SimpleNamespace(model_type="gpt2")), device="cpu")
    assert str(e.value) == f"could not load the converted checkpoint in {folder} ({'x' * 200})"
    assert converted.check_converted(str(folder), SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))).model_type == "gpt2"


def test_load_converted_in_float16_and_checks_parameters(tmp_path):
    original = make_tiny("llama")
    original.save_pretrained(tmp_path / "same")
    model = converted.load_converted(tmp_path / "same", original)
    assert all(p.dtype == torch.float16 for p in model.parameters()) and not model.training
    assert all(torch.equal(a, b.half()) for a, b in zip(model.parameters(), original.parameters()))
    on_meta = make_tiny("llama").to("meta")  # the converted model goes where the original is
    assert next(converted.load_converted(tmp_path / "same", on_meta).parameters()).device.type == "meta"
    assert next(converted.load_converted(tmp_path / "same", on_meta, device="cpu").parameters()).device.type == "cpu"
    streamed = converted.load_converted(tmp_path / "same", original, stream=True, device="cpu")  # block by block, in float16
    s = streamed_of(streamed)
    assert s is not None and s.dtype == torch.float16 and compute_device(streamed) == torch.device("cpu")
    assert all(p.device.type == "meta" and p.dtype == torch.float16 for p in streamed.parameters())
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 2]])
        assert torch.equal(streamed(input_ids=ids).logits, model(input_ids=ids).logits)  # the same float16 model
    other = type(original)(original.config.__class__.from_dict({**original.config.to_dict(), "intermediate_size": 96}))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(HalfsafeError, match="does not have the original's parameters"):
        converted.load_converted(tmp_path / "other", original)
    with pytest.raises(HalfsafeError, match="does not have the original's parameters"):
        converted.load_converted(tmp_path / "other", original, stream=True)


# --- plots: the data handed to the drawing functions -------------------------------------------------------------------


def _peaks(name: str, kl: float, layer_peaks: list[float]) -> VariantResult:
    r = _result(name, Metrics(kl_mean=kl))
    r.layer_peaks = layer_peaks
    return r


@pytest.fixture
def drawn(monkeypatch):
    calls = []
    monkeypatch.setattr(halfsafe.plots, "plot_bars", lambda *a: calls.append(("bars", *a)) or "BARS")
    monkeypatch.setattr(halfsafe.plots, "plot_layer_peaks", lambda *a: calls.append(("layers", *a)) or "LAYERS")
    return calls


def test_write_plots_hands_over_the_right_data(drawn, tmp_path):
    rep = VerifyReport("tiny", None, "llama", [], 8, 0, 0, ["l0", "l1"], [
        _peaks(REFERENCE, 0.0, [1e5, 2e5]), _peaks(BF16, 1e-3, [1.0, 2.0]), _peaks(FP16, math.nan, [math.inf, 1.0]),
        _peaks(HALFSAFE, 1e-5, [1e3, 2e3]), _peaks(CLAMP, math.inf, [3.0, 4.0])])
    assert write_plots(rep, tmp_path / "v.png") == ["BARS", "LAYERS"]
    (_, bars, path, ylabel, title), layers = drawn
    assert list(bars) == ["bf16", "fp16\n(non-finite)", "halfsafe fp16", "fp16 clamp\n(non-finite)"]
    assert bars["bf16"] == 1e-3 and bars["halfsafe fp16"] == 1e-5
    assert math.isnan(bars["fp16\n(non-finite)"]) and math.isnan(bars["fp16 clamp\n(non-finite)"])
    assert path == tmp_path / "v.png" and ylabel == "mean KL(fp32 || variant) per token (nats)"
    assert title == "tiny: divergence from float32, lower is better"
    assert layers == ("layers", {"original (fp32 run)": [1e5, 2e5], "halfsafe fp16 (measured)": [1e3, 2e3]},
                      tmp_path / "v-layers.png", "tiny: residual peak per layer, before and after")


def test_write_plots_falls_back_to_fp16_peaks_and_a_png_suffix(drawn, tmp_path):
    ref = _peaks(REFERENCE, 0.0, [5.0])
    rep = VerifyReport("t", None, "llama", [], 8, 0, 0, ["l0"], [ref, _peaks(FP16, 0.1, [2.0])])
    write_plots(rep, str(tmp_path / "plot"))
    assert drawn[1][1:3] == ({"original (fp32 run)": [5.0], "fp16 (measured)": [2.0]}, tmp_path / "plot-layers.png")
    drawn.clear()
    rep = VerifyReport("t", None, "llama", [], 8, 0, 0, ["l0"], [ref, _peaks(HALFSAFE, 0.1, [math.inf]), _peaks(FP16, 0.1, [3.0])])
    write_plots(rep, tmp_path / "p.svg")
    assert drawn[1][1:3] == ({"original (fp32 run)": [5.0], "fp16 (measured)": [3.0]}, tmp_path / "p-layers.svg")
    drawn.clear()
    write_plots(VerifyReport("t", None, "llama", [], 8, 0, 0, ["l0"], [ref, _peaks(FP16, 0.1, [math.nan])]), tmp_path / "q.png")
    assert drawn[1][1] == {"original (fp32 run)": [5.0]}


# --- runner ---------------------------------------------------------------------------------------------------------


def test_reference_cache_and_inputs(tmp_path, monkeypatch):
    cache = runner.ReferenceCache(tmp_path)
    x = torch.arange(6.0).reshape(1, 2, 3)
    cache.save(1, 2, x)
    cache.save(0, 0, torch.tensor([[[1.5, -2.0], [0.25, 8.0]]], dtype=torch.float16).transpose(1, 2))  # widened, made contiguous
    assert (tmp_path / "ref-1-2.f32").read_bytes() == bytes(torch.arange(6.0).numpy().data)  # raw float32, row-major
    assert (tmp_path / "ref-0-0.f32").read_bytes() == bytes(torch.tensor([1.5, 0.25, -2.0, 8.0]).numpy().data)
    assert cache.shapes == {(1, 2): (1, 2, 3), (0, 0): (1, 2, 2)} and cache.greedy == []
    rows = cache.load(1, 2)
    assert isinstance(rows, runner.Rows) and rows.path == tmp_path / "ref-1-2.f32" and rows.shape == (1, 2, 3)
    read = []  # ordinary reads of only the rows asked for: nothing mapped, no whole sample in memory
    real_open = open
    monkeypatch.setattr(runner, "open", lambda *a: read.append(a) or real_open(*a), raising=False)
    r = rows.rows(1, 65)  # clipped to the 2 rows there are
    assert r.dtype == torch.float32 and r.tolist() == [[3.0, 4.0, 5.0]] and read == [(tmp_path / "ref-1-2.f32", "rb")]
    assert rows.rows(0, 1).tolist() == [[0.0, 1.0, 2.0]] and rows.rows(0, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert rows.rows(2, 66).shape == (0, 3) and cache.load(0, 0).rows(1, 2).tolist() == [[-2.0, 8.0]]
    with monkeypatch.context() as m:
        made = []
        m.setattr(runner, "make_samples", lambda *a: made.append(a) or [torch.arange(10)[None] + 100 * len(made),
                                                                                      torch.arange(10)[None]])
        got = runner.prepare_inputs(["t1", "t2"], ["A", "B"], "TOK", 99, 16, 3, 4)
        assert made == [(["t1"], "TOK", 99, 16, 3), (["t2"], "TOK", 99, 16, 3)]
        assert [p.tolist() for p in got.prompts] == [[[100, 101, 102, 103]], [[200, 201, 202, 203]]]
    inputs = runner.prepare_inputs(["a" * 50, "b" * 30], ["A", "B"], None, 256, 16, 2, 5)
    assert inputs.names == ["A", "B"] and [len(s) for s in inputs.samples] == [2, 2]
    assert all(s.shape[1] <= 16 for t in inputs.samples for s in t)
    assert [p.tolist() for p in inputs.prompts] == [s[0][:, :5].tolist() for s in inputs.samples]
    assert inputs.prompts[0].shape == (1, 5)


def test_predicts_tokens_needs_an_output_embedding_and_generation():
    def fake(head, gen):
        return SimpleNamespace(get_output_embeddings=lambda: head, can_generate=lambda: gen)

    assert runner.predicts_tokens(fake(object(), True)) is True
    assert runner.predicts_tokens(fake(None, True)) is False
    assert runner.predicts_tokens(fake(object(), False)) is False


@torch.no_grad()
def test_runner_against_itself_and_a_different_model(tmp_path):
    model = make_tiny("llama")
    ids = [torch.tensor([[1, 5, 9, 2, 7, 3]]), torch.tensor([[4, 4, 8, 1]])]
    prompt = torch.tensor([[1, 5, 9]])
    inputs = runner.Inputs(["one", "two"], [[ids[0]], [ids[1]]], [prompt, torch.tensor([[4, 4]])])
    said = []
    run = runner.Runner(inputs, ["model.layers.0", "model.layers.1"], 3, tmp_path, said.append)
    ref = run.run_reference(model, VARIANTS[REFERENCE])
    assert said == ["fp32: text 1/2, sample 1/1", "fp32: greedy generation, text 1", "fp32: text 2/2, sample 1/1",
                    "fp32: greedy generation, text 2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref-0-0.f32", "ref-1-0.f32"]
    o = ref.overall
    assert (o.positions, o.nonfinite_logits, o.kl_mean, o.top1, o.max_abs_logit_error) == (10, 0, 0.0, 1.0, 0.0)
    assert (o.greedy_matched, o.greedy_total) == (6, 6) and len(ref.greedy_tokens) == 2
    assert [m.positions for m in ref.per_text] == [6, 4] and [m.greedy_total for m in ref.per_text] == [3, 3]
    assert ref.forward_tokens == 10 and ref.forward_seconds > 0 and ref.peak_activation_bytes > 0
    assert ref.memory_method == "live tensor bytes (dispatch-level tracking)"
    assert ref.parameter_bytes == parameter_bytes(model) and len(ref.layer_peaks) == 2 and min(ref.layer_peaks) > 0
    assert run.refs.greedy == ref.greedy_tokens
    # the perplexity: next-token NLL of both texts together
    nll = sum(nll_sum(model(input_ids=x).logits, x, False)[0] for x in ids)
    assert o.perplexity == pytest.approx(math.exp(nll / 8), rel=1e-6)
    with torch.no_grad():  # a model whose logits differ by 1 everywhere: same argmax, KL 0, error 1
        model.lm_head.bias = nn.Parameter(torch.ones(model.config.vocab_size))
    shifted = run.run(model, VARIANTS[FP16])
    assert run.refs.greedy == ref.greedy_tokens  # a compared run leaves the reference as it was
    s = shifted.overall
    assert s.max_abs_logit_error == pytest.approx(1.0, rel=1e-5) and s.top1 == 1.0 and s.kl_mean == pytest.approx(0.0, abs=1e-9)
    assert (s.greedy_matched, s.greedy_total) == (6, 6) and shifted.name == FP16
    assert not any(m._forward_hooks for m in model.modules())  # the block hooks are gone


def test_runner_without_greedy_and_for_models_that_cannot_generate(tmp_path):
    model = make_tiny("llama")
    inputs = runner.Inputs(["one"], [[torch.tensor([[1, 5, 9, 2]])]], [torch.tensor([[1]])])
    r = runner.Runner(inputs, [], 0, tmp_path, lambda m: None).run_reference(model, VARIANTS[REFERENCE])
    assert r.greedy_tokens == [] and r.overall.greedy_total is None and r.layer_peaks == []


def test_accumulator_module_helpers():
    assert accumulator._nanmax(1.0, 2.0) == 2.0 and accumulator._nanmax(3.0, 2.0) == 3.0
    assert math.isnan(accumulator._nanmax(math.nan, 1.0)) and math.isnan(accumulator._nanmax(1.0, math.nan))
    assert accumulator._exp(0.0) == 1.0 and accumulator._exp(1000.0) == math.inf
    assert matched_prefix([], [1]) == 0 and matched_prefix([1, 2], [1]) == 1
    # an all-zero accumulator: no division by zero, means 0
    m = Accumulator(lm=True).metrics()
    assert (m.positions, m.kl_mean, m.top1, m.perplexity, m.greedy_total) == (0, 0.0, 0.0, None, None)


# --- verify(): the wiring, every slow step replaced by a recorder ----------------------------------------------------


class _Original(nn.Module):
    """A stand-in for a loaded model: one float32 parameter, a config, a device."""

    def __init__(self, dtype=torch.float32, name: str = "org/name") -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.config = SimpleNamespace(model_type="llama", _name_or_path=name,
                                      get_text_config=lambda: SimpleNamespace(vocab_size=77))
        self.moved = []

    def to(self, device):
        self.moved.append(device)
        return self


@pytest.fixture
def wired(monkeypatch):
    calls = []
    loaded = SimpleNamespace(model=_Original(), tokenizer="TOK")
    state = {"fp16_reductions": False}

    class FakeRunner:
        def __init__(self, inputs, blocks, greedy_tokens, ref_dir, progress):
            calls.append(("runner", inputs.names, blocks, greedy_tokens, ref_dir.exists(), ref_dir.name[:16], progress("x")))
            state["ref_dir"] = ref_dir
            self.reads = Reads()  # nothing read: the report says nothing of reads

        def run_reference(self, model, variant):
            calls.append(("reference", model, variant.name, state["fp16_reductions"]))
            return "REF"

    @contextmanager
    def reductions():
        state["fp16_reductions"] = True
        yield
        state["fp16_reductions"] = False

    def prepare(texts, names, tokenizer, vocab, seq_len, max_samples, prompt_tokens):
        calls.append(("inputs", texts, names, tokenizer, vocab, seq_len, max_samples, prompt_tokens))
        return runner.Inputs(names, [[torch.zeros(1, 5), torch.zeros(1, 3)] for _ in texts], [])

    def run_patched(run, built, variant, results, skipped):
        calls.append(("run", built, variant.name))
        assert isinstance(run, FakeRunner)
        if variant.name == CLAMP:
            skipped[CLAMP] = "does not apply"
        else:
            results.append(f"{variant.name} result")

    @contextmanager
    def built(original, conv, from_converted, dtype, stream, device, progress):
        assert isinstance(original, _Original) and callable(progress)
        progress("building")
        calls.append(("build", stream, device))
        yield f"built {conv} {from_converted} {dtype}"
        calls.append("freed")

    def blocks(model):
        assert isinstance(model, _Original)
        return ["b0", "b1"]

    monkeypatch.setattr(halfsafe.io.loading, "load_model",
                        lambda source, dtype, stream, device: calls.append(("load", source, dtype, stream, device)) or loaded)
    monkeypatch.setattr(compare, "compute_device", lambda m: calls.append(("device of", m)) or "DEV")
    monkeypatch.setattr(compare, "heldout_text", lambda: "HELD")
    monkeypatch.setattr(compare, "Runner", FakeRunner)
    monkeypatch.setattr(compare, "exact_fp16_reductions", reductions)
    monkeypatch.setattr(compare, "prepare_inputs", prepare)
    monkeypatch.setattr(compare, "find_blocks", blocks)
    monkeypatch.setattr(compare, "check_converted", lambda c, o: calls.append(("check", c, o)))
    monkeypatch.setattr(compare, "_built", built)
    monkeypatch.setattr(compare, "_run_patched", run_patched)
    monkeypatch.setattr(compare, "environment", lambda dev: {"device": dev})
    return SimpleNamespace(calls=calls, loaded=loaded, state=state)


def test_verify_defaults_with_a_model_object(wired):
    original = _Original()
    rep = compare.verify(original)
    f16 = "built None False torch.float16"
    assert wired.calls == [
        ("device of", original),
        ("inputs", ["HELD"], ["held-out text (embedded)"], None, 77, 512, 2, 16),
        ("runner", ["held-out text (embedded)"], ["b0", "b1"], 32, True, "halfsafe-verify-", None),
        ("reference", original, "fp32", True),
        ("build", True, "DEV"), ("run", "built None False torch.bfloat16", "bf16"), "freed",
        ("build", True, "DEV"), ("run", f16, "fp16"), ("run", f16, "fp16 clamp"), ("run", f16, "fp16 + fp32 residual"), "freed",
    ]
    assert not wired.state["ref_dir"].exists()  # the reference logits are gone with the report
    assert original.moved == []
    assert rep == VerifyReport(
        model="org/name", converted=None, model_type="llama",
        texts=[{"name": "held-out text (embedded)", "samples": 2, "tokens": 8}], seq_len=512, greedy_tokens=32, prompt_tokens=16,
        layers=["b0", "b1"], results=["REF", "bf16 result", "fp16 result", "fp16 + fp32 residual result"],
        skipped={CLAMP: "does not apply"}, environment={"device": "DEV"},
        fp16_arith=fp16_arith.resolve(None, original))
    assert compare.verify(_Original(name="")).model == "_Original"
    nameless = _Original()
    del nameless.config._name_or_path
    assert compare.verify(nameless).model == "_Original"


def test_verify_options_with_folders(wired):
    said = []
    rep = compare.verify("orig", "conv", texts=["a", "b"], seq_len=64, max_samples=None, greedy_tokens=0, prompt_tokens=4,
                         variants=[HALFSAFE, FP16], device="cpu", progress=said.append)
    m = wired.loaded.model
    assert wired.calls == [
        ("load", "orig", torch.float32, True, "cpu"),
        ("device of", m),
        ("check", "conv", m),
        ("inputs", ["a", "b"], ["text 1", "text 2"], "TOK", 77, 64, None, 4),
        ("runner", ["text 1", "text 2"], ["b0", "b1"], 0, True, "halfsafe-verify-", None),
        ("reference", m, "fp32", True),
        ("build", True, "DEV"), ("run", "built conv False torch.float16", "fp16"), "freed",
        ("build", True, "DEV"), ("run", "built conv True torch.float16", "halfsafe fp16"), "freed",
    ]
    assert said == ["x", "building", "building"] and m.moved == []  # a folder is loaded onto the device
    assert (rep.model, rep.converted, rep.seq_len, rep.greedy_tokens, rep.prompt_tokens) == ("orig", "conv", 64, 0, 4)
    assert [t["name"] for t in rep.texts] == ["text 1", "text 2"]
    wired.calls.clear()
    half = _Original(torch.float16)
    rep = compare.verify(_Original(), half, texts=["a"], text_names=["A"], tokenizer="MINE", variants=[HALFSAFE])
    assert rep.converted == "(model object)"
    assert [c if isinstance(c, str) else c[0] for c in wired.calls] == ["device of", "inputs", "runner", "reference", "build", "run", "freed"]
    assert wired.calls[1][2:4] == (["A"], "MINE") and wired.calls[5] == ("run", "built _Original() True torch.float16", HALFSAFE)
    wired.calls.clear()
    compare.verify(Path("orig"), texts=["a"], tokenizer="MINE", variants=[FP16], stream=False)
    assert wired.calls[0] == ("load", Path("orig"), torch.float32, False, "auto") and wired.calls[2][3] == "MINE"  # resolved by load_model
    assert wired.calls[-3] == ("build", False, "DEV")
    wired.calls.clear()
    compare.verify("orig", variants=[], device=torch.device("cpu"))
    assert wired.calls[0] == ("load", "orig", torch.float32, True, torch.device("cpu"))  # load_model resolves it
    obj = _Original()
    compare.verify(obj, variants=[], device="cpu")
    compare.verify(obj, variants=[], device=torch.device("cpu"))
    assert obj.moved == ["cpu", "cpu"]  # a model object is moved to the device, resolved
    with pytest.raises(HalfsafeError, match="^unknown device 'tpu'"):
        compare.verify(obj, variants=[], device="tpu")


def test_verify_refuses_a_16_bit_original_and_unnamed_texts(wired):
    with pytest.raises(HalfsafeError, match="^verify needs the original in float32 \\(the reference\\); load it with "
                       "dtype=torch.float32$"):
        compare.verify(_Original(torch.float16))
    with pytest.raises(HalfsafeError, match="^give one name per text$"):
        compare.verify(_Original(), texts=["a", "b"], text_names=["A"])
    with pytest.raises(HalfsafeError, match="unknown variant"):
        compare.verify(_Original(), variants=["fp8"])
    assert [c[0] for c in wired.calls] == ["device of"]  # nothing loaded, built or run


def test_accumulator_sums_over_several_adds():
    """Two adds on one accumulator: every count and sum is the total of both (hand-made logits whose softmax is
    p or q)."""
    p, q = [0.9, 0.1], [0.4, 0.6]
    kl_pq = 0.9 * math.log(0.9 / 0.4) + 0.1 * math.log(0.1 / 0.6)
    ref = torch.tensor([[p, p]], dtype=torch.float64).log()
    out = torch.tensor([[q, p]], dtype=torch.float64).log()  # position 0 disagrees on the argmax, position 1 agrees
    ids = torch.tensor([[0, 1]])
    good = Accumulator(lm=True)
    assert good.has_greedy is False
    good.add(ref, out, ids, False)  # causal: position 0 predicts ids[1] = 1 with q[1] = 0.6
    good.add(ref, out, ids, True)  # teacher-forced: q[0] = 0.4 at position 0, p[1] = 0.1 at position 1
    nll = -math.log(0.6) - math.log(0.4) - math.log(0.1)
    assert good.kl_sum == pytest.approx(2 * kl_pq, rel=1e-12) and good.top1_hits == 2 and good.positions == 4
    assert good.nll_tokens == 3 and good.nll_sum == pytest.approx(nll, rel=1e-12)
    gm = good.metrics()
    assert type(gm.positions) is int and gm.kl_mean == pytest.approx(kl_pq / 2, rel=1e-12) and gm.top1 == 0.5
    assert gm.perplexity == pytest.approx(math.exp(nll / 3), rel=1e-12)
    bad = out.clone()
    bad[0, 1, 0] = math.inf
    acc = Accumulator(lm=True)
    acc.add(ref, out, ids, False)
    acc.add(ref, bad, ids, True)  # one infinite logit: position 1 still agrees (argmax 0)
    m = acc.metrics()
    assert (m.positions, m.nonfinite_logits, m.nonfinite_positions) == (4, 1, 1) and acc.top1_hits == 2
    assert acc.nll_tokens == 3 and acc.nll_sum == math.inf and math.isnan(acc.kl_sum) and m.max_abs_logit_error == math.inf
    acc.add(ref, bad, ids, False)
    assert (acc.nonfinite_logits, acc.nonfinite_positions, acc.positions, acc.nll_tokens) == (2, 2, 6, 4)
    one = Accumulator(lm=False)  # a single position: the mean is the value itself
    one.add(ref[:, :1], out[:, :1], ids[:, :1], False)
    assert one.metrics().kl_mean == pytest.approx(kl_pq, rel=1e-12) and one.metrics().top1 == 0.0


@pytest.mark.parametrize("rows", [1, 3])
def test_accumulator_sums_do_not_depend_on_the_chunk_of_positions(monkeypatch, rows):
    """The accumulator compares a few positions at a time (ROWS), against a tensor or a reference read back by
    rows; with 7 positions in chunks of 1 or 3 (a short last chunk) every sum equals the sum over all positions
    computed with torch's own kl_div, argmax and abs, and a `rows(lo, hi)` reference gives the same."""
    import halfsafe.verify.accumulator as accumulator

    monkeypatch.setattr(accumulator, "ROWS", rows)
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 7, 5, generator=g, dtype=torch.float64)  # every position different
    out = ref + 0.5 * torch.randn(1, 7, 5, generator=g, dtype=torch.float64)
    ids = torch.zeros(1, 7, dtype=torch.long)
    kl = sum(float(torch.nn.functional.kl_div(out[0, i].log_softmax(-1), ref[0, i].log_softmax(-1), log_target=True,
                                              reduction="sum")) for i in range(7))
    hits = int((ref[0].argmax(-1) == out[0].argmax(-1)).sum())
    assert 0 < hits < 7  # the sample tells positions apart

    class Read:  # the interface of a reference read back from disk
        def rows(self, lo, hi):
            return ref[0, lo:hi]

    for reference in (ref, Read()):
        acc = Accumulator(lm=False)
        acc.add(reference, out, ids, False)
        assert acc.positions == 7 and acc.top1_hits == hits
        assert acc.max_err == pytest.approx(float((out - ref).abs().max()), rel=1e-6)  # computed in float32
        assert acc.kl_sum == pytest.approx(kl, rel=1e-9)
