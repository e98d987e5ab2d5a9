"""llama.cpp's Vulkan backend with its float16 accumulators (scripts/setup-llama-vulkan, on scripts/install-webgpu's
lavapipe: tests/vulkanenv.py), proven first, then trusted.

The proof: the setup's probe multiplies F16 ones by ones through ggml on the Vulkan device; a float16 running sum of
4096 ones stalls at 2048, so prompt processing's matrix-matrix shaders give 2048 where float32 sums give 4096, the
matrix-vector path (one-token decode) and GGML_VK_DISABLE_F16=1 give 4096. Where the device computes otherwise the
tests that use the backend skip with the measured numbers: a result on it would prove nothing about float16.

Then a tiny Gemma 3 stressed past float16's range (tests/stress.py) as two F16 GGUFs by llama.cpp's own converter.
tests/stress.py's stress alone does not reach the accumulators: its values past 65504 are the residual stream and
Gemma's post-norm gains, which llama.cpp keeps in float32 between ops (its products peak near 600), so the last
block's MLP is grown until its down projection's output passes 65504, as a real overflow on a GPU does. ggml does not
write inf there: mul_mm.comp clamps float16 sums to +-65504 (ACC_TYPE_MAX) before storing them in float32, so the
unconverted GGUF (its bf16 weights cast to fp16) gives finite but wrong logits under Vulkan prompt processing (fp32's
argmax at 1 of 40 prompt positions), and fp32's on llama.cpp's CPU backend (float32 sums: the accumulators, not the
file); halfsafe's converted GGUF gives fp32's argmax and greedy tokens under Vulkan.

Time (2 busy cores): the first run of a new build compiles ggml's pipelines on lavapipe into its shader cache: 833 s
for the stressed model's first Vulkan run (once per build). Then the file takes ~70 s: the stressed model, its
conversion and its two GGUFs ~50 s, the four llama.cpp runs ~8 s, the proof ~1 s.
"""

from __future__ import annotations

import shutil

import llamaenv
import pytest
import torch
import vulkanenv
from safetensors.torch import load_file, save_file

from halfsafe.calibration import default_text, make_samples
from halfsafe.cli import main
from halfsafe.convert import convert_checkpoint
from halfsafe.core.forward import logits
from halfsafe.export.gguf import convert_with_llama_cpp, prepare_for_llama_cpp

PROMPT_TOKENS = (16, 24)  # over ggml's matrix-vector limit (8 columns): the float16 matrix-matrix shaders
NEW_TOKENS = 4
# fp32's top two logits apart by more than this share of the row's largest |logit|: a position where llama.cpp must
# give fp32's argmax. Measured on the stressed model's prompt positions: its CPU backend (float32 sums) misses one at
# 12% (and 5 of 22 under it), halfsafe's GGUF under Vulkan the same one; at 15% both hit every one (6 positions)
CLEAR = 0.15


@pytest.fixture(scope="module")
def vulkan():
    """(the setup's folder, the proof measured on its device), or a skip naming what is missing."""
    folder, why = vulkanenv.environment()
    if folder is None:
        pytest.skip(why)
    if (why := vulkanenv.device_missing()) is not None:
        pytest.skip(why)
    return folder, vulkanenv.proof(folder)


@pytest.fixture(scope="module")
def proven(vulkan):
    """The setup's folder once its device passed the proof; a skip with the measured numbers otherwise."""
    folder, measured = vulkan
    if wrong := vulkanenv.not_f16(measured):
        pytest.skip(f"llama.cpp's Vulkan device does not accumulate in f16 ((min, max) measured, f16's answer): {wrong}")
    return folder


def test_prompt_products_accumulate_in_f16_and_decode_products_do_not(vulkan):
    folder, measured = vulkan
    assert vulkanenv.not_f16(measured) == {}, measured
    sums = {case: (line["min"], line["max"]) for case, line in measured.items()}
    assert sums[(4096, 64, 64, False)] == (2048, 2048)  # float16 running sums: the stall
    assert sums[(4096, 64, 1, False)] == sums[(4096, 64, 64, True)] == (4096, 4096)  # float32 sums


def test_a_broken_probe_is_not_a_proof(vulkan):
    """not_f16 names any product that is not float16 accumulation's answer, and a missing one."""
    _, measured = vulkan
    for case in vulkanenv.F16_ANSWERS:
        other = {c: dict(line) for c, line in measured.items()}
        other[case]["max"] = other[case]["max"] + 1
        assert case in vulkanenv.not_f16(other)
        assert case in vulkanenv.not_f16({c: v for c, v in measured.items() if c != case})


def _tiny_gemma3():
    """tests/tiny's Gemma 3 in llama.cpp's layout (five sliding-window blocks then a global one), as
    tests/test_export_gguf.py runs it."""
    from tiny import TINY
    from vllmenv import randomised

    config = TINY["gemma3_text"]()
    config.num_hidden_layers, config.layer_types = 6, ["sliding_attention"] * 5 + ["full_attention"]
    return randomised(config)


@torch.no_grad()
def _overflow_a_product(model, run, margin_bits: float = 2.0) -> None:
    """Grow the last block's MLP until its down projection's output passes 65504 by `margin_bits` in fp32.

    tests/stress.py passes 65504 in the residual stream, which llama.cpp keeps in float32 between ops, and in Gemma's
    post-norm gains (elementwise, float32): its products stay under ~600, so no float16 accumulator overflows. Here
    up_proj (then gate_proj, where up_proj would pass 65504) doubles until the product itself passes the range, as a
    GPU's f16 matrix-matrix shader sums it; post_feedforward_layernorm renormalises what it writes."""
    from stress import FP16_MAX, weight_peak

    mlp = model.model.layers[-1].mlp
    peak = [0.0]
    hook = mlp.down_proj.register_forward_hook(lambda m, a, out: peak.__setitem__(0, max(peak[0], float(out.abs().max()))))
    try:
        for _ in range(16):
            peak[0] = 0.0
            run()
            if peak[0] > FP16_MAX * 2.0**margin_bits:
                return
            grow = mlp.up_proj.weight if mlp.up_proj.weight.abs().max() * 2 < FP16_MAX else mlp.gate_proj.weight
            grow *= 2.0
            assert weight_peak(model) < FP16_MAX, "every weight stays under 65504"
    finally:
        hook.remove()
    raise AssertionError(f"the down projection's output peaks at {peak[0]:.3g}, not past 65504")


@pytest.fixture(scope="module")
def stressed(proven, tmp_path_factory):
    """The stressed tiny Gemma 3 as two F16 GGUFs (unconverted: bf16 cast to fp16; halfsafe's: converted, exported by
    the CLI), its fp32 model, and the CPU set-up's folder (its converter; its CPU backend for contrast)."""
    cpu, why = llamaenv.environment()
    if cpu is None:
        pytest.skip(why)
    from stress import make_stress

    root = tmp_path_factory.mktemp("vulkan")
    model = _tiny_gemma3()
    calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
    run = lambda: [logits(model, ids) for ids in calib]  # noqa: E731
    make_stress(model, run)
    _overflow_a_product(model, run)
    model.to(torch.bfloat16).save_pretrained(root / "original")
    llamaenv.sentencepiece_model(cpu, root / "tokenizer.model", default_text())
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    shutil.copy(root / "tokenizer.model", root / "converted" / "tokenizer.model")
    assert main(["export", "gguf", str(root / "converted"), str(root / "halfsafe.gguf"), "--llama-cpp",
                 str(cpu / "llama.cpp")]) == 0
    half = root / "original-f16"
    half.mkdir()
    weights = {k: v.half() for k, v in load_file(root / "original" / "model.safetensors").items()}
    assert all(torch.isfinite(w).all() for w in weights.values())  # the stress keeps every weight under 65504
    save_file(weights, half / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (root / "original" / name).is_file():
            shutil.copy(root / "original" / name, half / name)
    shutil.copy(root / "tokenizer.model", half / "tokenizer.model")
    convert_with_llama_cpp(prepare_for_llama_cpp(half, root / "original-prepared"), root / "original.gguf", cpu / "llama.cpp")
    return {"root": root, "fp32": model.float().eval(), "cpu": cpu, "vulkan": proven}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, 160, (n,), generator=g).tolist() for n in PROMPT_TOKENS]  # the sentencepiece model's ids


def _run(stressed, gguf: str, backend: str) -> list[dict]:
    if backend == "vulkan":
        return llamaenv.run(stressed["vulkan"], stressed["root"] / gguf, _prompts(), NEW_TOKENS, n_gpu_layers=-1,
                            env=vulkanenv.runtime_env(stressed["vulkan"]), timeout=900)
    return llamaenv.run(stressed["cpu"], stressed["root"] / gguf, _prompts(), NEW_TOKENS)


def _finite(runs: list[dict]) -> bool:
    return all(torch.isfinite(torch.tensor(r["logits"])).all() for r in runs)


@torch.no_grad()
def _agreement(stressed, runs: list[dict]) -> tuple[int, int]:
    """(how many are fp32's, how many) of llama.cpp's argmaxes at the prompt positions where transformers fp32's top
    two logits are apart by more than CLEAR of the row's largest |logit|: where rounding cannot swap them."""
    agree = clear = 0
    for prompt, run in zip(_prompts(), runs):
        ref = stressed["fp32"](torch.tensor([prompt])).logits[0].double()
        for row, got in zip(ref, torch.tensor(run["logits"])):
            top2 = row.topk(2).values
            if top2[0] - top2[1] > CLEAR * row.abs().max():
                clear += 1
                agree += int(got.argmax() == row.argmax())
    return agree, clear


def test_unconverted_f16_gguf_saturates_under_vulkan_prompt_processing(stressed):
    """The stressed model's own weights in F16: under Vulkan prompt processing its last down projection's float16
    sums pass 65504 and ggml clamps them there (mul_mm.comp's ACC_TYPE_MAX): finite logits, but fp32's argmax at
    under half of the clear positions (measured: 1 of all 40); the same file on llama.cpp's CPU backend (float32 sums)
    gives fp32's argmax at every one: the accumulators, not the file."""
    vulkan, cpu = _run(stressed, "original.gguf", "vulkan"), _run(stressed, "original.gguf", "cpu")
    assert _finite(vulkan) and _finite(cpu)
    agree, clear = _agreement(stressed, cpu)
    assert agree == clear >= 4, (agree, clear)
    agree, clear = _agreement(stressed, vulkan)
    assert agree < clear / 2, f"Vulkan gave fp32's argmax at {agree} of {clear} clear positions: no overflow"


@torch.no_grad()
def test_halfsafe_gguf_is_finite_under_vulkan_with_fp32s_tokens(stressed):
    """halfsafe's GGUF of the same model under Vulkan prompt processing: every logit finite, fp32's argmax at every
    clear prompt position, and each greedy token transformers fp32's wherever fp32's top two are clearly apart."""
    runs = _run(stressed, "halfsafe.gguf", "vulkan")
    assert _finite(runs)
    agree, clear = _agreement(stressed, runs)
    assert agree == clear >= 4, (agree, clear)
    checked = 0
    for prompt, run in zip(_prompts(), runs):
        ids = prompt + run["greedy"]
        ref = stressed["fp32"](torch.tensor([ids])).logits[0].double()
        for i, token in enumerate(run["greedy"]):
            row = ref[len(prompt) - 1 + i]
            top2 = row.topk(2).values
            if top2[0] - top2[1] > CLEAR * row.abs().max():
                assert token == row.argmax().item(), f"greedy token {i} after {prompt}"
                checked += 1
    assert checked >= 2, f"only {checked} greedy steps had a clear top-2 margin"  # measured: 2 of 8
