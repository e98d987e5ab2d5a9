"""A real float16 WebGPU adapter in headless Chromium, for the browser tests and bench/runtimes/browser_webgpu.py:
scripts/install-browser-webgpu (Mesa's lavapipe from scripts/install-webgpu under SwiftShader's ids, the only Vulkan
adapter Debian's Chromium takes without external semaphores, and a chromium copy without SwiftShader) writes an env
file; clients/js/browser.mjs runs a page in that chromium with WebGPU on.

Before any test trusts the adapter, `f16_proof` runs examples/web/f16_proof.html there: a WGSL compute shader in f16
whose answers in float16 and in float32 differ (tests/webgpu.py's F16_ANSWERS, the same five outputs).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import jsclient
import numpy as np
import webgpu

from halfsafe.io.cache import cache_dir

ROOT = Path(__file__).resolve().parent.parent
INSTALLER = ROOT / "scripts" / "install-browser-webgpu"
SHIM = ROOT / "scripts" / "webgpu" / "vk_swiftshader_ids.c"
CHROMIUM = Path("/usr/lib/chromium/chromium")  # the binary install-browser-webgpu copies
WEB = ROOT / "examples" / "web"


def env_file() -> Path:
    """The env file install-browser-webgpu writes for this shim source and this chromium (its folder's digest)."""
    version = subprocess.run([str(CHROMIUM), "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256(SHIM.read_bytes() + version.rstrip("\n").encode() + b"\n").hexdigest()[:16]
    return cache_dir() / f"browser-webgpu-{digest}" / "env"


def missing() -> str | None:
    """Why the browser WebGPU tests cannot run here (a skip reason), or None."""
    reason = jsclient.chromium_missing()
    if reason is not None:
        return reason
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} missing (Debian's chromium package has it)"
    if env_file().is_file():
        return None
    why = cache_dir() / "browser-webgpu-missing"  # install-browser-webgpu's one line, when it could not make it
    if why.is_file() and why.read_text().strip():
        return why.read_text().strip().splitlines()[0]
    return f"no float16 WebGPU adapter in Chromium: {env_file()} missing (scripts/install-browser-webgpu makes it)"


def runtime_env(shader_cache: str | Path | None = None) -> dict:
    """os.environ plus the env file's variables (tests/webgpu.py's runtime_env: $HALFSAFE_SHADER_CACHE applies)."""
    return webgpu.runtime_env(shader_cache, file=env_file())


def page(url: str, env: dict, timeout: float = 600) -> dict:
    """`url` in the WebGPU chromium the env file names: what the page reports (browser.mjs's JSON)."""
    return jsclient.browser(url, timeout, mode="webgpu", chromium=env["HALFSAFE_WEBGPU_CHROMIUM"], env=env)


def serve(model: Path | dict[str, Path], name: str = "model"):
    """examples/web/serve.py's server in a thread for `model` (or {name: folder}): (server, base url); shut it down
    when done."""
    if str(WEB) not in sys.path:
        sys.path.insert(0, str(WEB))
    from serve import serve_in_thread

    return serve_in_thread(model, name=name)


def f16_proof(env: dict, url_page=None) -> dict:
    """examples/web/f16_proof.html in a browser (`url_page(url) -> browser.mjs's JSON`, by default `page` in `env`):
    what the page reports, with `outputs` (name -> float) decoded from its float16 bits when it computed them."""
    with tempfile.TemporaryDirectory(prefix="halfsafe-f16-proof-") as empty:  # serve.py serves some model folder
        server, url = serve(Path(empty))
        try:
            got = (url_page or (lambda u: page(u, env)))(f"{url}f16_proof.html")
        finally:
            server.shutdown()
    result = got["result"]
    if "bits" in result:
        result["outputs"] = {n: float(np.array(b, np.uint16).view(np.float16)) for n, b in result["bits"].items()}
    result["logs"] = got["logs"]
    return result
