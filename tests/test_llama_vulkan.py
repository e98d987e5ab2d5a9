"""llama.cpp's Vulkan backend with its float16 accumulators (scripts/setup-llama-vulkan, on scripts/install-webgpu's
lavapipe: tests/vulkanenv.py), proven first, then trusted.

The proof: the setup's probe multiplies F16 ones by ones through ggml on the Vulkan device; a float16 running sum of
4096 ones stalls at 2048, so prompt processing's matrix-matrix shaders give 2048 where float32 sums give 4096, the
matrix-vector path (one-token decode) and GGML_VK_DISABLE_F16=1 give 4096. Where the device computes otherwise the
tests that use the backend skip with the measured numbers: a result on it would prove nothing about float16.
"""

from __future__ import annotations

import pytest
import vulkanenv


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
