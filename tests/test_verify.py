"""`verify` and its baselines: on a tiny model end to end (API and CLI), and on the real Gemma 3 270M, where plain
fp16 is NaN, the converted checkpoint is finite and closer to fp32 than bf16, and the clamp baseline is not."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from stress import make_stress
from tiny import make_tiny, tiny_ids

from halfsafe.calibration import default_text, heldout_text, make_samples
from halfsafe.convert import make_fp16_safe
from halfsafe.core.forward import logits
from halfsafe.core.sites import find_blocks
from halfsafe.engine.fp16_arith import fp16_arith
from halfsafe.engine.precision import cast_copy
from halfsafe.runtime.baselines import clamp_residual_adds, keep_residual_fp32, residual_writers
from halfsafe.verify import (
    ALL_VARIANTS,
    BF16,
    CLAMP,
    FP16,
    FP32_RESIDUAL,
    HALFSAFE,
    HALFSAFE_FP32_RESIDUAL,
    REFERENCE,
    markdown_table,
    verify,
    write_plots,
)

METRICS = {"positions", "nonfinite_logits", "nonfinite_positions", "kl_mean", "top1", "perplexity", "max_abs_logit_error",
           "greedy_matched", "greedy_total", "greedy_fraction"}
PER_VARIANT = {"name", "dtype", "custom_runtime", "converted", "description", "overall", "per_text", "parameter_bytes",
               "peak_activation_bytes", "memory_method", "layer_peaks", "greedy_tokens", "forward_seconds"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _block_outputs(model, ids):
    """The hidden state each block returns (the residual stream after it)."""
    modules = dict(model.named_modules())
    seen = []
    hooks = [modules[b].register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
             for b in find_blocks(model)]
    try:
        logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _check_json(data: dict, variants: list[str]) -> None:
    data = json.loads(json.dumps(data, allow_nan=True))  # serialisable as it is
    assert [v["name"] for v in data["variants"]] == variants
    for v in data["variants"]:
        assert PER_VARIANT <= set(v), PER_VARIANT - set(v)
        assert METRICS <= set(v["overall"]), METRICS - set(v["overall"])
        assert len(v["per_text"]) == len(data["texts"]) and all(METRICS <= set(m) for m in v["per_text"])
        assert v["parameter_bytes"] > 0 and v["peak_activation_bytes"] > 0
        assert len(v["layer_peaks"]) == len(data["layers"])
    assert {"torch", "transformers", "cpu", "cpu_cores"} <= set(data["environment"])


def _check_pngs(paths) -> None:
    assert len(paths) == 2
    for p in paths:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == PNG_MAGIC


# --- tiny model: fast --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny Llama whose activations overflow fp16 (tests/stress.py) and its halfsafe conversion in fp16: the
    plan is not empty, so the converted model really differs from the original."""
    model = make_tiny("llama")
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    conv = copy.deepcopy(model)
    report = make_fp16_safe(conv, calib, progress=False)
    assert report.plan.exponents.get("residual", 0) < 0
    return model, cast_copy(conv, torch.float16).eval()


def test_verify_api_end_to_end_on_a_tiny_model(tiny_pair, tmp_path):
    model, half = tiny_pair
    texts = [heldout_text()[:600], default_text()[:300]]
    report = verify(model, half, texts=texts, text_names=["a", "b"], seq_len=48, max_samples=2, greedy_tokens=4, prompt_tokens=6)
    assert [r.name for r in report.results] == list(ALL_VARIANTS)
    assert [t["name"] for t in report.texts] == ["a", "b"] and report.texts[0]["samples"] == 2
    tokens = report.texts[0]["tokens"] + report.texts[1]["tokens"]
    assert all(r.overall.positions == tokens for r in report.results)
    assert report.result(FP16).overall.nonfinite_logits > 0 and math.isnan(report.result(FP16).overall.kl_mean)
    bf16, conv = report.result(BF16).overall, report.result(HALFSAFE).overall
    assert conv.nonfinite_logits == 0 and conv.kl_mean <= bf16.kl_mean / 10, (conv.kl_mean, bf16.kl_mean)
    for r in report.results:
        assert r.variant.custom_runtime == (r.name in (CLAMP, FP32_RESIDUAL, HALFSAFE_FP32_RESIDUAL))
    # half the bytes, less the rotary frequencies that stay float32 (as from_pretrained keeps them)
    assert report.result(FP16).parameter_bytes * 2 == pytest.approx(report.result(REFERENCE).parameter_bytes, abs=1024)
    _check_json(report.to_dict(), list(ALL_VARIANTS))
    _check_pngs(write_plots(report, tmp_path / "v.png"))
    table = markdown_table(report)
    assert all(f"| {v} |" in table for v in ALL_VARIANTS)
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ") for line in table.splitlines()[2:]}
    kib = lambda n: f"{n / 2**10:,.1f} KiB"  # noqa: E731  (tiny models: under a MiB)
    for name in (REFERENCE, FP16, HALFSAFE):
        r = report.result(name)
        o = r.overall
        nan = o.kl_mean != o.kl_mean
        assert rows[name] == [
            name, "yes" if r.variant.custom_runtime else "no", f"{o.nonfinite_logits:,}",
            "0 (reference)" if name == REFERENCE else ("NaN" if nan else f"{o.kl_mean:.2e}"),
            "-" if name == REFERENCE else f"{100 * o.top1:.2f}%", "NaN" if o.perplexity != o.perplexity else f"{o.perplexity:.3f}",
            f"{o.greedy_matched}/{o.greedy_total}", "NaN" if o.max_abs_logit_error != o.max_abs_logit_error else f"{o.max_abs_logit_error:.3g}",
            kib(r.parameter_bytes), kib(r.peak_activation_bytes),
        ], name


def _independent_metrics(model, variant, samples, prompts, n_greedy) -> dict:
    """The numbers verify reports, computed here with torch's own functions from the two models' outputs."""
    kl = top1 = nll = positions = nll_tokens = nonfinite = 0
    max_err = 0.0
    for ids in samples:
        ref = model(input_ids=ids).logits.double()[0]
        out = variant(input_ids=ids).logits.double()[0]
        nonfinite += int((~torch.isfinite(out)).sum())
        kl += float(F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="sum"))
        top1 += int((ref.argmax(-1) == out.argmax(-1)).sum())
        nll += float(F.cross_entropy(out[:-1], ids[0, 1:], reduction="sum"))
        nll_tokens += ids.shape[1] - 1
        positions += ids.shape[1]
        max_err = max(max_err, float((out - ref).abs().max()))
    matched = total = 0
    for prompt in prompts:
        gen = dict(max_new_tokens=n_greedy, min_new_tokens=n_greedy, do_sample=False, attention_mask=torch.ones_like(prompt))
        a = model.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
        b = variant.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        matched, total = matched + same, total + len(a)
    return {"kl_mean": kl / positions, "top1": top1 / positions, "perplexity": math.exp(nll / nll_tokens),
            "max_abs_logit_error": max_err, "nonfinite_logits": nonfinite, "greedy_matched": matched, "greedy_total": total}


@torch.no_grad()
def test_verify_metrics_match_an_independent_computation(tiny_pair):
    model, half = tiny_pair
    text = heldout_text()[:500]
    report = verify(model, half, texts=[text], seq_len=40, max_samples=2, greedy_tokens=6, prompt_tokens=5,
                    variants=[BF16, FP16, HALFSAFE])
    samples = make_samples([text], None, model.config.vocab_size, 40, 2)
    prompts = [samples[0][:, :5]]
    # the float16 variants in the arithmetic verify ran them in (its report says which): PyTorch's own float16 kernels
    # and float32 ones rounded once round a few products differently on some CPUs (AMD EPYC)
    arith = {BF16: "native", FP16: report.fp16_arith["used"], HALFSAFE: report.fp16_arith["used"]}
    for name, variant in ((BF16, cast_copy(model, torch.bfloat16)), (FP16, cast_copy(model, torch.float16)), (HALFSAFE, half)):
        with fp16_arith(arith[name]):
            want = _independent_metrics(model, variant, samples, prompts, 6)
        got = report.result(name).overall
        assert got.nonfinite_logits == want["nonfinite_logits"], name
        assert (got.greedy_matched, got.greedy_total) == (want["greedy_matched"], want["greedy_total"]), name
        assert got.top1 == pytest.approx(want["top1"]), name
        if name == FP16:  # NaN logits: the metrics say so rather than inventing numbers
            assert want["nonfinite_logits"] > 0 and math.isnan(got.kl_mean) and want["greedy_matched"] < 6
            assert got.top1 < 1
            continue
        assert got.kl_mean == pytest.approx(want["kl_mean"], rel=1e-4, abs=1e-12), name
        assert got.perplexity == pytest.approx(want["perplexity"], rel=1e-6), name
        assert got.max_abs_logit_error == pytest.approx(want["max_abs_logit_error"], rel=1e-4), name
    assert report.result(BF16).overall.kl_mean > report.result(HALFSAFE).overall.kl_mean > 0


def test_verify_without_a_converted_model_runs_the_baselines_only(tiny_pair):
    model, _ = tiny_pair
    report = verify(model, texts=["hello world, " * 20], seq_len=32, max_samples=1, greedy_tokens=0, variants=[FP16, HALFSAFE])
    assert [r.name for r in report.results] == [REFERENCE, FP16]
    assert HALFSAFE in report.skipped and report.result(FP16).overall.greedy_total is None


def test_clamp_clamps_each_residual_add_and_nothing_else():
    model = make_tiny("gemma3_text")
    ids = tiny_ids(model)
    ref = logits(model, ids)
    with clamp_residual_adds(model, 1e30) as h:  # far above every value: the model's function is untouched
        assert torch.equal(logits(model, ids), ref)
    assert h.adds == 2 * model.config.num_hidden_layers
    limit = 0.5 * max(float(x.abs().max()) for x in _block_outputs(model, ids))
    with clamp_residual_adds(model, limit):
        outs = _block_outputs(model, ids)
        assert not torch.equal(logits(model, ids), ref)
    assert all(float(x.abs().max()) <= limit for x in outs)  # every block ends on a clamped add
    assert torch.equal(logits(model, ids), ref)  # removed


@pytest.mark.parametrize("key", ["llama", "gemma3_text", "gpt2", "gpt_neox", "t5"])
def test_keep_residual_fp32_keeps_weights_fp16_and_the_stream_fp32(key):
    model = make_tiny(key)
    ids = tiny_ids(model)
    ref = logits(model, ids)
    half = cast_copy(model, torch.float16)
    assert all(x.dtype == torch.float16 for x in _block_outputs(half, ids))
    with keep_residual_fp32(half):
        assert all(x.dtype == torch.float32 for x in _block_outputs(half, ids))
        out = logits(half, ids).float()
    assert all(p.dtype == torch.float16 for p in half.parameters())
    assert torch.isfinite(out).all() and float((out - ref).abs().max()) < 1e-2
    assert all(x.dtype == torch.float16 for x in _block_outputs(half, ids))  # removed
    assert len(residual_writers(half)) >= 2 * len(find_blocks(half))  # T5 decoder blocks have 3


def test_cli_verify_on_tiny_checkpoints(tmp_path):
    from halfsafe.cli import main
    from halfsafe.convert import convert_checkpoint

    src, out = tmp_path / "tiny", tmp_path / "tiny-fp16"
    make_tiny("qwen2").save_pretrained(src)
    convert_checkpoint(str(src), str(out), seq_len=32, max_samples=1, progress=False)
    text = tmp_path / "t.txt"
    text.write_text(heldout_text()[:400])
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["verify", str(src), str(out), "--text", str(text), "--seq-len", "32", "--max-samples", "1",
               "--greedy-tokens", "3", "--json", str(js), "--plot", str(png)])
    assert rc == 0
    data = json.loads(js.read_text())
    _check_json(data, list(ALL_VARIANTS))
    assert data["texts"][0]["name"] == "t.txt" and data["converted"] == str(out)
    _check_pngs([png, tmp_path / "r-layers.png"])
    assert main(["verify", str(src), str(tmp_path / "missing")]) == 2


# --- the real Gemma 3 270M: slow ---------------------------------------------------------------------------------

GEMMA_VARIANTS = [BF16, FP16, CLAMP, FP32_RESIDUAL, HALFSAFE]
GREEDY = 16


@pytest.fixture(scope="module")
def gemma3_report(gemma3_folder, gemma3_converted):
    # fp16 matmuls are slow on CPUs: one short sample, 16 greedy tokens
    return verify(str(gemma3_folder), gemma3_converted, seq_len=96, max_samples=1, greedy_tokens=GREEDY, prompt_tokens=8,
                  variants=GEMMA_VARIANTS)


@pytest.mark.slow
def test_gemma3_plain_fp16_is_non_finite_and_converted_fp16_beats_bf16(gemma3_report, gemma3_converted):
    r = gemma3_report
    fp16, bf16, conv = r.result(FP16).overall, r.result(BF16).overall, r.result(HALFSAFE).overall
    assert fp16.nonfinite_logits > 0 and math.isnan(fp16.kl_mean)
    assert conv.nonfinite_logits == 0 and bf16.nonfinite_logits == 0
    # measured on this 96-token sample: 1.50e-5 against bf16's 9.33e-4 (62x); top-1 95/96 for both; greedy 16/16
    # (bf16: 14/16, clamp: 4/16)
    assert conv.kl_mean < bf16.kl_mean / 20, (conv.kl_mean, bf16.kl_mean)
    assert conv.top1 >= 0.98 and conv.greedy_matched == conv.greedy_total == GREEDY
    assert not r.result(HALFSAFE).variant.custom_runtime
    peak_before, peak_after = max(r.result(REFERENCE).layer_peaks), max(r.result(HALFSAFE).layer_peaks)
    bits = json.loads((gemma3_converted / "halfsafe.json").read_text())["plan"]["headroom_bits"]
    assert peak_before > 65504 > 2 ** bits * peak_after  # the plan's margin holds on held-out text


@pytest.mark.slow
def test_gemma3_clamp_baseline_is_finite_but_worse_than_bf16_and_converted(gemma3_report):
    clamp, conv, bf16 = gemma3_report.result(CLAMP), gemma3_report.result(HALFSAFE), gemma3_report.result(BF16)
    assert clamp.overall.nonfinite_logits == 0 and clamp.variant.custom_runtime
    # measured: clamp KL 0.33 against bf16's 9.3e-4 (350x worse) and halfsafe's 1.5e-5; greedy 4/16 against 16/16
    assert clamp.overall.kl_mean > 10 * bf16.overall.kl_mean > 100 * conv.overall.kl_mean
    assert clamp.overall.greedy_matched < conv.overall.greedy_matched


@pytest.mark.slow
def test_gemma3_fp32_residual_fixes_the_original_at_the_cost_of_runtime_code(gemma3_report):
    r, fp16 = gemma3_report.result(FP32_RESIDUAL), gemma3_report.result(FP16)
    assert fp16.overall.nonfinite_logits > 0  # the same weights without it overflow
    assert r.overall.nonfinite_logits == 0 and r.overall.kl_mean < gemma3_report.result(BF16).overall.kl_mean / 20
    assert r.variant.custom_runtime


@pytest.mark.slow
def test_gemma3_report_json_and_png(gemma3_report, tmp_path):
    _check_json(gemma3_report.to_dict(), [REFERENCE, *GEMMA_VARIANTS])
    _check_pngs(write_plots(gemma3_report, tmp_path / "gemma3.png"))


@pytest.mark.slow
def test_keep_residual_fp32_makes_the_original_gemma3_finite(gemma3_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gemma3_folder, dtype=torch.float16).eval()
    ids = AutoTokenizer.from_pretrained(gemma3_folder)(heldout_text()[:300], return_tensors="pt").input_ids[:, :48]
    assert not torch.isfinite(logits(model, ids)).all()  # plain fp16 overflows
    with keep_residual_fp32(model):
        outs = _block_outputs(model, ids)
        out = logits(model, ids)
    assert all(x.dtype == torch.float32 for x in outs) and torch.isfinite(out).all()
    assert all(p.dtype == torch.float16 for p in model.parameters())
