"""scripts/install-webgpu writes the cache path into an env file that the tests and the user source, and into a JSON
ICD manifest: whatever the path holds (`$(...)`, backquotes, quotes, spaces, backslashes), sourcing the file runs
nothing and sets each variable to the exact path, and the manifest names the exact driver file. Run with stand-ins
for apt-get, apt-cache, dpkg, dpkg-query and dpkg-deb first on PATH (they log nothing to the network and unpack an
empty lavapipe), so nothing is downloaded and no package changes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import webgpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCRIPT = webgpu.INSTALLER
MESA = re.search(r"^MESA=(\S+)", SCRIPT.read_text(), re.MULTILINE).group(1).split("-")[0]
BASH = shutil.which("bash")
STAND_INS = {
    "apt-get": 'for a; do :; done; [ "$a" = update ] || touch mesa-vulkan-drivers.deb',  # update; download PKGS
    "apt-cache": "exit 0",  # no dependency left to fetch
    "dpkg": "echo amd64",
    "dpkg-query": "exit 1",
    "dpkg-deb": 'mkdir -p "$3/usr/lib/x86_64-linux-gnu" && touch "$3/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so" '
                '"$3/usr/lib/x86_64-linux-gnu/libvulkan.so.1"',  # -x DEB DIR
}
HOSTILE = ["$(touch pwned)", "`touch pwned`", "a b", "it's", 'say "hi"', "back\\slash", "$HOME", "${x:-y}", ";touch pwned;",
           "&& touch pwned", "*", "~", "#x", "!!", "'$(touch pwned)'", '"$(touch pwned)"']

pytestmark = pytest.mark.skipif("bookworm" not in Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else True,
                                reason="scripts/install-webgpu's recipe is for Debian 12 (bookworm), which it checks first")


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!{BASH}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _install(cache: Path, bin_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HALFSAFE_CACHE": str(cache), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([BASH, str(SCRIPT)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def _check(cache: Path, bin_dir: Path, work: Path, monkeypatch) -> None:
    work.mkdir(parents=True)
    done = _install(cache, bin_dir, work)
    dest = cache / f"webgpu-mesa-{MESA}"
    assert done.returncode == 0 and done.stdout == f"{dest}/env\n", done.stderr
    # sourced by bash, as a user would: the values come back NUL-separated, exactly
    dump = '. "$1" && printf "%s\\0" "$LD_LIBRARY_PATH" "$VK_ICD_FILENAMES" "$MESA_SHADER_CACHE_DIR"'
    for before in (None, "/usr/lib/before"):
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"} | ({"LD_LIBRARY_PATH": before} if before else {})
        sourced = subprocess.run([BASH, "-c", dump, "bash", str(dest / "env")], env=env, cwd=work, capture_output=True,
                                 timeout=30)
        assert sourced.returncode == 0 and sourced.stderr == b"", sourced.stderr
        lib = f"{dest}/lib" + (f":{before}" if before else "")
        assert os.fsdecode(sourced.stdout).split("\0")[:3] == [lib, f"{dest}/lvp_icd.json", f"{cache}/webgpu-shader-cache"]
    assert not list(work.iterdir()) and not list(cache.rglob("pwned")), "sourcing the env file ran a command"
    icd = json.loads((dest / "lvp_icd.json").read_text())
    assert icd["ICD"]["library_path"] == f"{dest}/lib/libvulkan_lvp.so"
    # the tests' own reader of the file (tests/webgpu.py) gets the same values
    monkeypatch.setenv("HALFSAFE_CACHE", str(cache))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv(webgpu.SHADER_CACHE_VAR, raising=False)
    read = webgpu.runtime_env()
    assert (read["LD_LIBRARY_PATH"], read["VK_ICD_FILENAMES"], read["MESA_SHADER_CACHE_DIR"]) == \
        (f"{dest}/lib", f"{dest}/lvp_icd.json", f"{cache}/webgpu-shader-cache")


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_cache_path_is_written_as_a_path(name, stand_ins, tmp_path, monkeypatch):
    _check(tmp_path / name / "cache", stand_ins, tmp_path / "work", monkeypatch)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(st.characters(max_codepoint=0x17f, blacklist_categories=("Cc", "Cs"), blacklist_characters="/"), min_size=1,
                    max_size=24).filter(lambda s: s not in (".", "..")))
def test_any_cache_path_is_written_as_a_path(name, stand_ins, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("any")
    _check(root / name / "cache", stand_ins, root / "work", monkeypatch)


def test_a_control_character_in_the_cache_path_is_refused_in_one_line(stand_ins, tmp_path):
    cache = tmp_path / "a\nb"
    done = _install(cache, stand_ins, tmp_path)
    assert done.returncode == 0 and done.stdout == "" and "holds a control character" in done.stderr
    assert not (cache / f"webgpu-mesa-{MESA}").exists()
