"""halfsafe's fp16 ONNX exports on a real float16 runtime: transformers.js 4 in Node with device 'webgpu' (ONNX
Runtime's WebGPU provider on Mesa's lavapipe, proven to compute in float16 first: tests/webgpu.py), and in headless
Chromium (examples/web, the section at the end).

Tiny Gemma 3 (and Llama, with HALFSAFE_WEBGPU_ALL=1) are stressed until their fp32 activations pass 65504 by 2 bits (tests/stress.py), saved in
bf16, converted by halfsafe and exported (`halfsafe export onnx`); Gemma 3's unconverted stressed checkpoint is
exported too. On WebGPU the converted exports stay finite and close to transformers fp32, while the unconverted one
overflows. ONNX Runtime's CPU provider, which every other transformers.js test runs, computes the float16 graph in
float32: the unconverted export is finite and close to fp32 there, so only this runtime checks float16 arithmetic.

Time (measured on two busy cores, CPU seconds): the three exports and two conversions ~65 s; the runs in Node ~28 s
with no compiled shader, ~6 s once lavapipe has compiled them into MESA_SHADER_CACHE_DIR (halfsafe's cache; set
HALFSAFE_SHADER_CACHE to a fresh folder to measure the cold case).
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import browser_webgpu  # noqa: E402
import jsclient  # noqa: E402
import onnx  # noqa: E402
import webgpu  # noqa: E402
from jsclient import save_char_tokenizer  # noqa: E402
from stress import make_stress  # noqa: E402
from test_export_onnx import assert_greedy_equal  # noqa: E402
from tiny import make_tiny  # noqa: E402

from halfsafe.calibration import default_text, make_samples  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.forward import logits  # noqa: E402
from halfsafe.core.metrics import mean_kl  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny configs (tests/tiny): Gemma 3's language model; Llama too with HALFSAFE_WEBGPU_ALL=1 (its export costs ~25 s,
# and it passes: KL below)
FAMILIES = ("gemma3_text", "llama") if os.environ.get("HALFSAFE_WEBGPU_ALL") else ("gemma3_text",)
PROMPT = "The quick brown fox jumps over the lazy dog"  # 44 tokens with <bos>: past the tiny Gemma 3's sliding window
NEW_TOKENS = 16
# KL(fp32 || WebGPU float16) in nats per token over the prompt. Measured: 5.3e-7 (Gemma 3, worst token 1.0e-5) and
# 1.7e-7 (Llama, worst 8.7e-7); the same exports on the CPU provider (float32 inside): 3.0e-8 and 1.6e-8
KL_BOUND = {"gemma3_text": 3e-6, "llama": 1e-6}


@dataclass
class Stressed:
    """A stressed tiny model's folders and its fp32 reference on the prompt (transformers on the CPU)."""

    root: Path
    tokenizer: object
    fp32: torch.nn.Module  # the bf16 checkpoint's weights, in float32
    ids: torch.Tensor  # the prompt, as transformers encodes it
    want: list[int]  # fp32's greedy tokens after the prompt
    ref: torch.Tensor  # fp32's logits over the prompt

    def export(self, which: str) -> Path:
        """`halfsafe export onnx` of the "converted" or the "original" (unconverted) checkpoint, made on first use."""
        out = self.root / f"{which}-onnx"
        if not out.exists():
            export_onnx(self.root / which, out)
        return out


@pytest.fixture(scope="module")
def stressed(tmp_path_factory):
    """key -> Stressed: a tiny model stressed past fp16's range, saved in bf16 and converted (built on first use)."""
    from transformers import AutoTokenizer

    built = {}

    def get(key: str) -> Stressed:
        if key not in built:
            root = tmp_path_factory.mktemp(key)
            model = make_tiny(key)
            calib = make_samples([default_text()], None, model.config.vocab_size, 32, 2)
            make_stress(model, lambda: [logits(model, ids) for ids in calib])
            model.to(torch.bfloat16).save_pretrained(root / "original")
            save_char_tokenizer(root / "original", model.config)
            convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
            fp32 = model.float().eval()
            tokenizer = AutoTokenizer.from_pretrained(root / "original")
            ids = tokenizer(PROMPT, return_tensors="pt").input_ids
            with torch.no_grad():
                want = fp32.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
                ref = fp32(ids).logits.double()
            built[key] = Stressed(root, tokenizer, fp32, ids, want[0, ids.shape[1]:].tolist(), ref)
        return built[key]

    return get


def _logits(got: dict, path: Path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, np.float32).reshape(got["logits"]["dims"])).double()


def test_adapter_computes_in_float16(webgpu_runtime):
    """The proof the fixture checked, and that it tells float16 from float32: the CPU provider fails it."""
    assert webgpu_runtime.proof == webgpu.F16_ANSWERS
    cpu = webgpu.f16_proof(webgpu_runtime.env, device="cpu")
    assert webgpu.not_f16(cpu) == {"sum_of_ones": (4096.0, 2048.0), "product_over_300": (300.0, float("inf")),
                                   "one_plus_small_minus_one": (pytest.approx(webgpu.SMALL, rel=1e-3), 0.0)}


@pytest.mark.parametrize("key", FAMILIES)
def test_every_float16_node_runs_on_webgpu(key, stressed, webgpu_runtime):
    """ONNX Runtime leaves shape arithmetic on its CPU provider even with WebGPU (measured on Gemma 3: 45 of 304 nodes,
    int64 and bool, and the Cast of the int64 positions to float32); no node that outputs float16 may be there, as the
    CPU provider would compute it in float32."""
    path = stressed(key).export("converted") / ONNX_FILE
    placed = webgpu.placements(path, webgpu_runtime.env)
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    dtypes = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]}
    nodes = {n.name: n for n in proto.graph.node}
    on_cpu = [name for name, provider in placed.items() if provider == "CPUExecutionProvider"]
    assert all(name in nodes and all(o in dtypes for o in nodes[name].output) for name in on_cpu), on_cpu
    assert not [n for n in on_cpu if any(dtypes[o] == onnx.TensorProto.FLOAT16 for o in nodes[n].output)]
    assert all(placed[n.name] == "WebGpuExecutionProvider" for n in proto.graph.node if n.op_type == "MatMul")


@pytest.mark.parametrize("key", FAMILIES)
def test_converted_export_on_webgpu_is_finite_and_matches_fp32(key, stressed, webgpu_runtime, tmp_path):
    """pipeline('text-generation', id, {device: 'webgpu'}) on the converted export: finite logits, fp32's greedy
    tokens, and a KL to fp32 within a few times what was measured."""
    s = stressed(key)
    got = jsclient.run(s.export("converted"), "tjs4", prompt=PROMPT, ids=s.ids[0].tolist(), new_tokens=NEW_TOKENS,
                       logits_out=tmp_path / "webgpu.f32", device="webgpu", env=webgpu_runtime.env)
    assert got["device"] == "webgpu" and got["prompt_ids"] == s.ids[0].tolist()
    assert got["logits"]["dtype"] == "float32" and got["logits"]["finite"]
    assert_greedy_equal(s.fp32, s.ids, got["generate_ids"], s.want)
    assert got["pipeline_text"] == s.tokenizer.decode(got["generate_ids"], skip_special_tokens=True)
    kl = mean_kl(s.ref, _logits(got, tmp_path / "webgpu.f32"))
    assert kl < KL_BOUND[key], kl


@pytest.mark.parametrize("key", ["gemma3_text"])  # Llama's unconverted export too: none finite on WebGPU, finite on
# the CPU provider (KL 7.1e-10), measured; left out, as its export alone costs ~25 s on two busy cores
def test_unconverted_export_overflows_on_webgpu_but_not_on_the_cpu_provider(key, stressed, webgpu_runtime, tmp_path):
    """The unconverted stressed export: non-finite logits in float16 arithmetic (so the test above has teeth), yet
    finite and close to fp32 on ONNX Runtime's CPU provider, which computes the float16 graph in float32."""
    s = stressed(key)
    ids = s.ids[0].tolist()
    got = jsclient.run(s.export("original"), "tjs4", ids=ids, new_tokens=1, device="webgpu", env=webgpu_runtime.env)
    assert not got["logits"]["finite"]  # measured: none of the 44 x 256 logits finite
    cpu = jsclient.run(s.export("original"), "tjs4", ids=ids, new_tokens=1, logits_out=tmp_path / "cpu.f32")
    assert cpu["logits"]["finite"]
    kl = mean_kl(s.ref, _logits(cpu, tmp_path / "cpu.f32"))
    assert kl < 1e-6, kl  # measured 1.7e-8: the CPU provider passes what float16 arithmetic breaks

# ----------------------------------------------------------------------------------------------------------------
# The same exports in a browser: examples/web in headless Chromium on a real float16 WebGPU adapter, lavapipe under
# SwiftShader's ids (tests/browser_webgpu.py, scripts/install-browser-webgpu), proven by a WGSL float16 proof in the
# page before any test trusts it. Debian's Chromium alone offers only SwiftShader, which has no shader-f16. Gemma 3
# only, transformers.js 4 (3.8.1, ONNX Runtime Web's JSEP build, was measured to do the same: the same text, none
# finite; left out, as its shaders cost another ~35 s cold). In this module so that the stressed models and their
# exports are made once for Node and the browser; a page takes ~10 s warm (load 6 s, 16 tokens 3 s).
# ----------------------------------------------------------------------------------------------------------------

BROWSER_KEY = "gemma3_text"


@pytest.fixture(scope="module")
def browser_gpu():
    """The WebGPU chromium's environment, its adapter proven to compute in float16 in the page: skips where the set-up
    is missing (the reason install-browser-webgpu wrote), fails where it exists and the proof does not hold."""
    reason = browser_webgpu.missing()
    if reason is not None:
        pytest.skip(reason)
    env = browser_webgpu.runtime_env()
    proof = browser_webgpu.f16_proof(env)
    if "error" in proof:
        pytest.fail(f"the browser's WebGPU float16 proof did not run: {proof['error']} (adapter {proof.get('adapter')}, "
                    f"logs {proof['logs'][-5:]})")
    wrong = webgpu.not_f16(proof["outputs"])
    if wrong:
        pytest.fail(f"the browser's WebGPU adapter does not compute in float16 (output: (measured, float16's)): {wrong}")
    return webgpu.Runtime(env, proof)


def _page(folder, env, **params) -> dict:
    """examples/web's page on `folder` with `params` (lib, device, prompt, ...) in the WebGPU chromium."""
    server, url = browser_webgpu.serve(folder)
    try:
        got = browser_webgpu.page(f"{url}?{urllib.parse.urlencode(params)}", env)
    finally:
        server.shutdown()
    assert "error" not in got["result"], (got["result"], got["logs"][-5:])
    return got["result"]


def test_page_adapter_computes_in_float16(browser_gpu):
    """The proof the fixture checked (shader-f16 on lavapipe under SwiftShader's name), and that it tells adapters
    apart: Debian's chromium with WebGPU on its own SwiftShader has no shader-f16, so the proof computes nothing."""
    proof = browser_gpu.proof
    assert proof["outputs"] == webgpu.F16_ANSWERS and proof["shader_f16"]
    assert (proof["adapter"]["vendor"], proof["adapter"]["architecture"]) == ("google", "swiftshader")
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith(("VK_", "MESA_"))}
    plain = browser_webgpu.f16_proof(plain_env, url_page=lambda url: jsclient.browser(url, 120, mode="webgpu", env=plain_env))
    assert plain["shader_f16"] is False and "outputs" not in plain, plain


def test_converted_export_generates_fp32s_tokens_on_float16_webgpu(stressed, browser_gpu):
    """device=webgpu, transformers.js 4: the prompt encoded as transformers does, finite float32 logits whose last
    argmax is fp32's, and the text of fp32's greedy tokens (the page reports the pipeline's text, as a user sees it)."""
    s = stressed(BROWSER_KEY)
    got = _page(s.export("converted"), browser_gpu.env, lib="tjs4", device="webgpu", prompt=PROMPT, tokens=NEW_TOKENS,
                check="logits")
    assert got["device"] == "webgpu" and got["version"] == "4.3.2"
    assert got["prompt_ids"] == s.ids[0].tolist()
    assert got["logits"]["dtype"] == "float32" and got["logits"]["finite"]
    assert got["logits"]["argmax"] == s.want[0]
    assert got["text"] == s.tokenizer.decode(s.want, skip_special_tokens=True)


def test_unconverted_export_overflows_on_float16_webgpu(stressed, browser_gpu):
    """The unconverted stressed export in the same page: non-finite logits in float16 arithmetic (so the test above
    has teeth)."""
    s = stressed(BROWSER_KEY)
    got = _page(s.export("original"), browser_gpu.env, lib="tjs4", device="webgpu", prompt=PROMPT, tokens=1, check="logits")
    assert got["device"] == "webgpu" and got["prompt_ids"] == s.ids[0].tolist()
    assert got["logits"]["dtype"] == "float32" and not got["logits"]["finite"]


# time_steps.html: the plain graph (`--split-k none`) and the default (split-K) of the converted export, timed in turn
# in one page (bench/runtimes/browser_webgpu.py --steps runs it on Gemma 3 270M); a prefill of a few tokens and a decode step
# after a past longer than the tiny Gemma 3's sliding window
STEP_IDS, STEP_PAST, STEP_ROUNDS = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48], 12, 2


def test_time_steps_page_times_plain_and_default_in_turn(stressed, browser_gpu):
    """Every export's warm-up and every round's prefill and decode step: a finite positive time, its ratio to the
    plain graph's; the feeds as clients/js/time_steps.mjs makes them (positions from 0, the decode step's past of
    STEP_PAST tokens) and the outputs they give (the present one longer than the past). No assertion on times."""
    from halfsafe.runtime.profiles import SplitK

    s = stressed(BROWSER_KEY)
    plain = s.root / "converted-plain-onnx"
    if not plain.exists():
        export_onnx(s.root / "converted", plain, split_k=SplitK())
    folders = {"plain": plain, "default": s.export("converted")}
    server, url = browser_webgpu.serve(folders)
    try:
        query = urllib.parse.urlencode({"models": ",".join(folders), "ids": ",".join(map(str, STEP_IDS)),
                                        "past": STEP_PAST, "rounds": STEP_ROUNDS})
        got = browser_webgpu.page(f"{url}time_steps.html?{query}", browser_gpu.env)
    finally:
        server.shutdown()
    r = got["result"]
    assert "error" not in r, (r, got["logs"][-5:])
    assert r["adapter"] == {**{k: browser_gpu.proof["adapter"][k] for k in ("vendor", "architecture", "description")},
                            "shader_f16": True}
    assert (r["prefill"], r["past"], r["rounds"]) == (len(STEP_IDS), STEP_PAST, STEP_ROUNDS)
    config = s.fp32.config
    n, heads, dim, vocab = len(STEP_IDS), config.num_key_value_heads, config.head_dim, config.vocab_size
    assert r["feeds"] == {
        "prefill": {"input_ids": [1, n], "attention_mask": [1, n], "positions": [0, n - 1], "kv": [1, heads, 0, dim]},
        "decode": {"input_ids": [1, 1], "attention_mask": [1, STEP_PAST + 1], "positions": [STEP_PAST, STEP_PAST],
                   "kv": [1, heads, STEP_PAST, dim]}}
    step_out = {"prefill": {"logits": [1, n, vocab], "kv": [1, heads, n, dim]},
                "decode": {"logits": [1, 1, vocab], "kv": [1, heads, STEP_PAST + 1, dim]}}
    assert r["outputs"] == {name: step_out for name in folders}

    def positive(t):
        return isinstance(t, (int, float)) and np.isfinite(t) and t > 0

    for step in ("prefill", "decode"):
        times = r[f"{step}_s"]
        assert list(times) == list(r["warm_s"][step]) == list(r["ratio"][step]) == list(folders)
        for name in folders:
            assert positive(r["warm_s"][step][name])
            assert len(times[name]) == len(r["ratio"][step][name]) == STEP_ROUNDS
            assert all(map(positive, times[name] + r["ratio"][step][name]))
            assert r["ratio"][step][name] == [t / b for t, b in zip(times[name], times["plain"])]
            assert positive(r["median"][step][name]) and positive(r["median_ratio"][step][name])
