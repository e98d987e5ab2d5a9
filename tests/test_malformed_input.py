"""Malformed model folders, each one line on stderr with exit 2 (no traceback), naming the file, the field or tensor and
the fix, before the slow part, on every command that reads a model and in the Python API: a config.json that is not
a JSON object or whose fields hold the wrong kind of value (property-tested over the fields of a real config), a
tensor of a dtype halfsafe does not read, and a FIFO (or device) named like any file halfsafe or transformers would
open from the folder, which is refused without being opened (a reader of a FIFO waits forever for a writer)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import test_inputs_complete
import torch
from hostile import SHORT, copy_of, folder_hash, refused, returns_within, tiny_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tiny import make_tiny

import halfsafe.convert
from halfsafe.cli import main
from halfsafe.errors import HalfsafeError

pytestmark = pytest.mark.usefixtures("one_thread")


tiny = test_inputs_complete.tiny  # its fixture: a tiny llama with a tokenizer, as a released checkpoint ships them


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(tiny_plan()))
    return path


def every_command(model: Path, out: Path, plan: Path) -> dict[str, list[str]]:
    """Each command that reads a model folder, on `model` (export reads a converted folder: `model` stands for one)."""
    return {"scan": ["scan", str(model), *SHORT],
            "convert": ["convert", str(model), str(out), *SHORT],
            "convert --whole": ["convert", str(model), str(out), "--whole", *SHORT],
            "verify": ["verify", str(model), "--seq-len", "32", "--max-samples", "1", "--greedy-tokens", "0"],
            "apply": ["apply", str(plan), str(model), str(out), *SHORT],
            "finetune": ["finetune", str(model), str(out), *SHORT],
            "export onnx": ["export", "onnx", str(model), str(out)]}


@pytest.fixture
def no_slow_part(monkeypatch):
    def slow(*args, **kwargs):
        raise AssertionError("the slow part ran")

    import sys

    import halfsafe.verify.compare as compare

    monkeypatch.setattr(halfsafe.convert, "make_fp16_safe", slow)
    monkeypatch.setattr(sys.modules["halfsafe.scan"], "scan", slow)
    monkeypatch.setattr(compare, "Runner", slow)


# ----- config.json --------------------------------------------------------------------------------------------------

CONFIG_CASES = {  # name -> (the field replaced, None: the whole file; the value put there; what the line says)
    "a JSON list": (None, [1, 2], "holds a list, not a JSON object"),
    "a JSON string": (None, "llama", "holds a string, not a JSON object"),
    "a JSON number": (None, 3, "holds a number, not a JSON object"),
    "JSON null": (None, None, "holds null, not a JSON object"),
    # types: transformers' typed config refuses them, in one line naming the field
    "quoted layers": ("num_hidden_layers", "2", "'num_hidden_layers'"),
    "quoted width": ("hidden_size", "64", "'hidden_size'"),
    "float layers": ("num_hidden_layers", 2.0, "'num_hidden_layers'"),
    "int activation": ("hidden_act", 3, "'hidden_act'"),
    # what transformers takes and then fails on, or builds quietly wrong: halfsafe's own checks (io/config_fields.py)
    "bool heads": ("num_attention_heads", True, "num_attention_heads is true (a boolean)"),
    "negative layers": ("num_hidden_layers", -1, "num_hidden_layers is -1 (a number)"),
    "zero heads": ("num_attention_heads", 0, "num_attention_heads is 0 (a number)"),
    "string eps": ("rms_norm_eps", "1e-6", 'rms_norm_eps is "1e-6" (a string)'),
    "infinite eps": ("rms_norm_eps", 1e999, "rms_norm_eps is Infinity"),
    "string tie": ("tie_word_embeddings", "no", 'tie_word_embeddings is "no" (a string)'),
    "string architectures": ("architectures", "LlamaForCausalLM", 'architectures is "LlamaForCausalLM" (a string)'),
    # a model no skeleton can be built from: refused where the skeleton is built, before any weight is read
    "padding id past the vocabulary": ("pad_token_id", 256, "Padding_idx must be within num_embeddings"),
    "a trillion kv heads": ("num_key_value_heads", 10**12, "cannot build"),
}


def _with_config(folder: Path, field: str | None, value) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(value if field is None else {**config, field: value}))


COMMANDS = ["scan", "convert", "convert --whole", "verify", "apply", "finetune", "export onnx"]
# every case on scan; one of each kind (the whole file, a type, a range, a model no skeleton holds) on every command
EVERY = ["a JSON list", "quoted layers", "negative layers", "padding id past the vocabulary"]


@pytest.mark.parametrize("case, command", [(c, "scan") for c in sorted(CONFIG_CASES)] +
                         [(c, m) for c in EVERY for m in COMMANDS if m != "scan"])
def test_a_malformed_config_is_one_line_on_every_command(tiny, plan, tmp_path, capsys, no_slow_part, case, command):
    field, value, says = CONFIG_CASES[case]
    folder = copy_of(tiny, tmp_path / "model")
    _with_config(folder, field, value)
    before, out = folder_hash(folder), tmp_path / "out"
    refused(capsys, every_command(folder, out, plan)[command], "config.json", says, "fix")
    assert folder_hash(folder) == before and not out.exists()


@pytest.mark.parametrize("case", ["quoted layers", "a JSON list"])
def test_a_malformed_config_is_a_halfsafe_error_in_the_api(tiny, tmp_path, case):
    from halfsafe.io.loading import load_model

    field, value, says = CONFIG_CASES[case]
    folder = copy_of(tiny, tmp_path / "model")
    _with_config(folder, field, value)
    for stream in (True, False):
        with pytest.raises(HalfsafeError, match="config.json"):
            load_model(folder, stream=stream)
    with pytest.raises(HalfsafeError, match="config.json"):
        halfsafe.convert.convert_checkpoint(str(folder), str(tmp_path / "out"), seq_len=32, max_samples=1, progress=False)
    assert not (tmp_path / "out").exists()


FIELDS = sorted(json.loads(make_tiny("llama").config.to_json_string()))
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
MUTATION = st.one_of(
    st.tuples(st.none(), JSON),  # the whole file
    st.tuples(st.sampled_from(FIELDS), JSON),  # one field, to any JSON value
    st.tuples(st.sampled_from(FIELDS), st.integers(-3, 3).map(str)),  # a quoted number
    st.tuples(st.sampled_from(FIELDS), st.sampled_from([-1, 0, 1, 2.0, 0.5, True, False, None, 10**12])),
)


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATION)
def test_any_json_in_a_config_field_scans_or_is_refused_in_one_line(tiny, tmp_path_factory, capsys, mutation):
    """A valid config.json with one field (or the whole file) replaced by another JSON value: `scan` exits 0, or 2 with
    one line on stderr; never a traceback (an exception out of main fails this test with it)."""
    field, value = mutation
    folder = copy_of(tiny, tmp_path_factory.mktemp("mutated") / "model")
    _with_config(folder, field, value)
    capsys.readouterr()
    code = main(["scan", str(folder), *SHORT])
    err = capsys.readouterr().err.strip()
    assert code in (0, 2), (mutation, code, err)
    if code == 2:
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (mutation, err)


# ----- dtypes halfsafe does not read --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_tensor_of_a_dtype_halfsafe_does_not_read_is_one_line(tiny, plan, tmp_path, capsys, no_slow_part, dtype, command):
    folder = copy_of(tiny, tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.extra_counts"] = torch.arange(6, dtype=torch.int64).to(dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    stored = {torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}[dtype]
    refused(capsys, every_command(folder, tmp_path / "out", plan)[command], "model.safetensors",
            f"stores model.layers.0.extra_counts as {stored}", "re-save")
    assert not (tmp_path / "out").exists()


# ----- FIFOs named like the files a load opens ----------------------------------------------------------------------

FIFO_NAMES = ["config.json", "generation_config.json", "tokenizer_config.json", "preprocessor_config.json",
              "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "chat_template.jinja", "model.safetensors",
              "model.safetensors.index.json", "model-00001-of-00002.safetensors", "halfsafe.json", "model.gguf"]


@pytest.mark.parametrize("name", FIFO_NAMES)
@pytest.mark.parametrize("command", ["scan", "convert", "verify"])
def test_a_fifo_named_like_a_model_file_is_refused_without_being_opened(tiny, tmp_path, capsys, name, command):
    folder = copy_of(tiny, tmp_path / "model")
    if (folder / name).exists():
        (folder / name).unlink()
    os.mkfifo(folder / name)
    argv = {"scan": ["scan", str(folder), *SHORT], "convert": ["convert", str(folder), str(tmp_path / "out"), *SHORT],
            "verify": ["verify", str(folder), "--seq-len", "32", "--max-samples", "1", "--greedy-tokens", "0"]}[command]
    err = returns_within(lambda: refused(capsys, argv, name, "FIFO"), [folder / name])
    assert "not a file" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["gguf", "tokenizer-folder", "subfolder"])
def test_a_fifo_given_or_beside_the_model_is_refused(tiny, tmp_path, capsys, where):
    """A FIFO named as the GGUF to read, one in the --tokenizer folder, one in a folder inside MODEL."""
    folder = copy_of(tiny, tmp_path / "model")
    if where == "gguf":
        fifo = tmp_path / "model.gguf"
        argv = ["scan", str(fifo), *SHORT]
    elif where == "tokenizer-folder":
        tok = copy_of(tiny, tmp_path / "tok")
        (tok / "tokenizer.json").unlink()
        fifo = tok / "tokenizer.json"
        argv = ["scan", str(folder), "--tokenizer", str(tok), *SHORT]
    else:
        (folder / "extra").mkdir()
        fifo = folder / "extra" / "tokenizer.json"
        argv = ["scan", str(folder), *SHORT]
    os.mkfifo(fifo)
    returns_within(lambda: refused(capsys, argv, fifo.name, "FIFO"), [fifo])
