"""scripts/install-browser-webgpu writes the cache path into an env file that the tests and the user source, and into
the shim's JSON ICD manifest: whatever the path holds, sourcing the file runs nothing and sets each variable to the
exact path, the manifest names the exact shim, and tests/browser_webgpu.py finds the folder (the same digest of the
shim's source and the chromium version). The chromium copy lacks SwiftShader's Vulkan driver and its binary is a file
of its own (Chromium looks for its files beside /proc/self/exe). Never fails: a missing gcc or a control character
is one line, exit 0. install-webgpu runs under test_install_webgpu.py's stand-ins (an empty lavapipe, nothing
downloaded); the shim is really built."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import browser_webgpu
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_install_webgpu import BASH, MESA, STAND_INS

SCRIPT = browser_webgpu.INSTALLER
HOSTILE = ["$(touch pwned)", "`touch pwned`", "it's ${x:-y}", 'say "hi"', "back\\slash *"]  # each install ~3 s

pytestmark = [
    pytest.mark.skipif("bookworm" not in Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else True,
                       reason="scripts/install-webgpu's recipe is for Debian 12 (bookworm), which it checks first"),
    pytest.mark.skipif(not browser_webgpu.CHROMIUM.is_file(), reason=f"{browser_webgpu.CHROMIUM} missing (Debian's chromium)"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed"),
]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!{BASH}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _install(cache: Path, bin_dir: Path, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HALFSAFE_CACHE": str(cache), "PATH": path or f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([BASH, str(SCRIPT)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _check(cache: Path, bin_dir: Path, work: Path, monkeypatch) -> None:
    work.mkdir(parents=True)
    done = _install(cache, bin_dir, work)
    monkeypatch.setenv("HALFSAFE_CACHE", str(cache))
    dest = browser_webgpu.env_file().parent  # the tests' digest names the folder the script made
    assert done.returncode == 0 and done.stdout == f"{dest}/env\n", done.stderr
    names = ["LD_LIBRARY_PATH", "VK_ICD_FILENAMES", "MESA_SHADER_CACHE_DIR", "HALFSAFE_WEBGPU_CHROMIUM"]
    dump = '. "$1" && shift && for n; do printf "%s\\0" "${!n}"; done'
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    sourced = subprocess.run([BASH, "-c", dump, "bash", str(dest / "env"), *names], env=env, cwd=work, capture_output=True, timeout=30)
    assert sourced.returncode == 0 and sourced.stderr == b"", sourced.stderr
    want = [f"{cache}/webgpu-mesa-{MESA}/lib", f"{dest}/icd.json", f"{cache}/webgpu-shader-cache", f"{dest}/chromium/chromium"]
    assert os.fsdecode(sourced.stdout).split("\0")[:4] == want
    assert not list(work.iterdir()) and not list(cache.rglob("pwned")), "sourcing the env file ran a command"
    assert json.loads((dest / "icd.json").read_text())["ICD"]["library_path"] == f"{dest}/vk_swiftshader_ids.so"
    copy = dest / "chromium"
    assert not (copy / "libvk_swiftshader.so").exists() and not (copy / "vk_swiftshader_icd.json").exists()
    assert not (copy / "chromium").is_symlink()  # else /proc/self/exe is /usr/lib/chromium's, SwiftShader beside it
    assert (copy / "chromium").samefile(browser_webgpu.CHROMIUM) or \
        (copy / "chromium").read_bytes() == browser_webgpu.CHROMIUM.read_bytes()
    assert (copy / "resources.pak").resolve() == browser_webgpu.CHROMIUM.parent / "resources.pak"
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv("HALFSAFE_SHADER_CACHE", raising=False)
    read = browser_webgpu.runtime_env()  # the tests' own reader of the file
    assert [read[n] for n in names] == want


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_cache_path_is_written_as_a_path(name, stand_ins, tmp_path, monkeypatch):
    _check(tmp_path / name / "cache", stand_ins, tmp_path / "work", monkeypatch)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(st.characters(max_codepoint=0x17f, blacklist_categories=("Cc", "Cs"), blacklist_characters="/"), min_size=1,
                    max_size=24).filter(lambda s: s not in (".", "..")))
def test_any_cache_path_is_written_as_a_path(name, stand_ins, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("any")
    _check(root / name / "cache", stand_ins, root / "work", monkeypatch)


def test_without_gcc_it_says_why_in_one_line_and_makes_nothing(stand_ins, tmp_path):
    bin_dir = tmp_path / "bin"  # the stand-ins and what the script runs, without gcc
    shutil.copytree(stand_ins, bin_dir)
    for tool in ("bash", "dirname", "mkdir", "mktemp", "grep", "rm", "cp", "ln", "mv", "cat", "tee", "sha256sum", "cut",
                 "chmod", "head", "tr", "sed", "printf", "id", "command"):
        if (found := shutil.which(tool)) and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    cache = tmp_path / "cache"
    done = _install(cache, stand_ins, tmp_path, path=str(bin_dir))
    reason = (cache / "browser-webgpu-missing").read_text()
    assert done.returncode == 0 and done.stdout == "" and reason == "no float16 WebGPU adapter in Chromium: needs gcc to build the Vulkan shim\n"
    assert not [p for p in cache.glob("browser-webgpu-*") if p.is_dir()]


def test_a_control_character_in_the_cache_path_is_refused_in_one_line(stand_ins, tmp_path):
    cache = tmp_path / "a\nb"
    done = _install(cache, stand_ins, tmp_path)
    assert done.returncode == 0 and done.stdout == "" and "holds a control character" in done.stderr
    assert not [p for p in cache.glob("browser-webgpu-*") if p.is_dir()]
