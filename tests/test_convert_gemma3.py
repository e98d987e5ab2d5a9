"""The real Gemma 3 270M, converted: an ordinary fp16 checkpoint that plain transformers runs finite
and that generates what fp32 generates."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from halfsafe.calibration import default_text, heldout_text

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def fp16_model(gemma3_converted):
    return AutoModelForCausalLM.from_pretrained(gemma3_converted, dtype=torch.float16).eval()


@pytest.fixture(scope="module")
def fp32_original(gemma3_folder):
    return AutoModelForCausalLM.from_pretrained(gemma3_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(gemma3_converted):
    return AutoTokenizer.from_pretrained(gemma3_converted)


def test_checkpoint_is_plain_fp16_with_plan_and_card(gemma3_converted):
    with safe_open(gemma3_converted / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F16"}
    info = json.loads((gemma3_converted / "halfsafe.json").read_text())
    plan = info["plan"]
    assert plan["family"] == "gemma3_text" and plan["exponents"]["residual"] < 0
    assert plan["tensors"] and all({"param", "kind", "exponent"} <= set(t) for t in plan["tensors"])
    assert info["halfsafe_version"] and info["transformers_version"]
    assert info["peak_before"] > 65504
    assert "float16 conversion (halfsafe)" in (gemma3_converted / "README.md").read_text()
    assert json.loads((gemma3_converted / "config.json").read_text())["dtype"] == "float16"


@torch.no_grad()
def test_plain_transformers_fp16_is_finite_on_default_text_and_2048_tokens(fp16_model, tokenizer):
    ids = tokenizer(default_text(), return_tensors="pt").input_ids[:, :512]
    assert torch.isfinite(fp16_model(ids).logits).all()
    long = tokenizer(heldout_text() + default_text(), return_tensors="pt").input_ids[:, :2048]
    assert long.shape[1] == 2048
    assert torch.isfinite(fp16_model(long, logits_to_keep=64).logits).all()


@torch.no_grad()
def test_real_fp16_residual_peaks_keep_the_promised_headroom_on_held_out_text(fp16_model, tokenizer, gemma3_converted):
    """Not the planner's prediction: the saved checkpoint, loaded by plain transformers in fp16, measured."""
    info = json.loads((gemma3_converted / "halfsafe.json").read_text())
    bits = info["plan"]["headroom_bits"]
    ids = tokenizer(heldout_text(), return_tensors="pt").input_ids[:, :256]
    peaks = []
    hooks = [layer.register_forward_hook(lambda m, a, out: peaks.append(float(out[0].float().abs().max())))
             for layer in fp16_model.model.layers]
    try:
        fp16_model(ids, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    assert len(peaks) == len(info["peaks_after"])
    # 1/4 bit of slack for text the plan never saw
    assert max(peaks) <= 65504 * 2.0 ** (-bits + 0.25), (max(peaks), bits)
    # the prediction was about the calibration text; on other text it holds within half a bit
    predicted = list(info["peaks_after"].values())
    assert max(peaks) == pytest.approx(max(predicted), rel=0.5)


def test_tokenizer_travels_with_the_checkpoint(gemma3_folder, gemma3_converted):
    src, out = AutoTokenizer.from_pretrained(gemma3_folder), AutoTokenizer.from_pretrained(gemma3_converted)
    text = heldout_text()[:500]
    assert src(text).input_ids == out(text).input_ids and len(out) == len(src)


@torch.no_grad()
def test_original_in_plain_fp16_is_nan(gemma3_folder, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(gemma3_folder, dtype=torch.float16).eval()
    ids = tokenizer(PROMPTS[0] + " " + default_text()[:400], return_tensors="pt").input_ids
    assert not torch.isfinite(model(ids).logits).all()


@torch.no_grad()
def test_greedy_generation_matches_fp32(fp16_model, fp32_original, tokenizer):
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = fp32_original.generate(ids, max_new_tokens=32, do_sample=False)
        out = fp16_model.generate(ids, max_new_tokens=32, do_sample=False)
        assert torch.equal(out, ref), f"{prompt!r}: {tokenizer.decode(out[0])!r} vs {tokenizer.decode(ref[0])!r}"
