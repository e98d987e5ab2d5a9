"""examples/web on a real float16 WebGPU adapter in headless Chromium: lavapipe (Mesa's CPU Vulkan driver, with
shaderFloat16) under SwiftShader's ids (tests/browser_webgpu.py, scripts/install-browser-webgpu), proven by a WGSL
float16 proof in the browser before any test trusts it. Debian's Chromium alone offers only SwiftShader, which has no
shader-f16, so without this the page never ran halfsafe's fp16 export in float16 arithmetic.

A tiny Gemma 3 stressed past float16's range (tests/test_webgpu.py's `stressed`): the converted export generates
transformers fp32's greedy tokens in the page with device=webgpu (transformers.js 4, the folder's model_fp16.onnx),
while the unconverted export's logits are non-finite there. transformers.js 3.8.1 (ONNX Runtime Web's JSEP build) was
measured to do the same (the same text; none finite) and is left out: its shaders cost another ~35 s cold.

Time (measured on two cores shared with other work, load ~4): the file 141 s once lavapipe has compiled the shaders
into MESA_SHADER_CACHE_DIR, 206 s with none (HALFSAFE_SHADER_CACHE=a fresh folder); most of it is the stress, the
conversion and the two exports, a page ~10 s warm (load 6 s, 16 tokens 3 s).
"""

from __future__ import annotations

import os
import urllib.parse

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

import browser_webgpu  # noqa: E402
import jsclient  # noqa: E402
import test_webgpu  # noqa: E402
import webgpu  # noqa: E402
from test_webgpu import NEW_TOKENS, PROMPT  # noqa: E402

stressed = test_webgpu.stressed  # its module fixture: a tiny model stressed past float16's range, converted, exported

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "gemma3_text"  # one family: its exports are the slow part


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
    s = stressed(KEY)
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
    s = stressed(KEY)
    got = _page(s.export("original"), browser_gpu.env, lib="tjs4", device="webgpu", prompt=PROMPT, tokens=1, check="logits")
    assert got["device"] == "webgpu" and got["prompt_ids"] == s.ids[0].tolist()
    assert got["logits"]["dtype"] == "float32" and not got["logits"]["finite"]
