"""What halfsafe reads is what transformers loads: the same files and the same tensors, on every loader path (the
streamed load, the whole load, the checks before either, and the fingerprint that says which files are the weights of
a folder halfsafe wrote); a folder that leaves the choice to an accident (a tensor in two weight files, no index
transformers reads that says which) is refused in one line naming both files, before anything is loaded.

Each folder here is built from two different tiny models (A and B: seeds 0 and 1), so reading the wrong file gives
other numbers, never the same ones by chance; what transformers loads is its own `from_pretrained`, called directly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hostile import SHORT, copy_of, folder_hash, refused, returns_within
from safetensors.torch import load_file, save_file
from tiny import save_tiny
from transformers import LlamaForCausalLM

from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import HalfsafeError
from halfsafe.io.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, dict, dict]:
    """Tiny llama A's folder, and the tensors of A and of B (another tiny llama of the same shapes)."""
    root = tmp_path_factory.mktemp("pair")
    a = save_tiny("llama", root / "a")
    b = save_tiny("llama", root / "b", seed=1)
    return a, load_file(a / "model.safetensors"), load_file(b / "model.safetensors")


def _save(tensors: dict, path: Path) -> None:
    save_file(tensors, path, metadata={"format": "pt"})


def _shard(folder: Path, tensors: dict, weight_map: dict | None = None) -> None:
    """`tensors` as two shards and their index (`weight_map`: the index's own, where given)."""
    keys = sorted(tensors)
    first = {k: tensors[k] for k in keys[: len(keys) // 2]}
    second = {k: tensors[k] for k in keys[len(keys) // 2:]}
    _save(first, folder / SHARD1)
    _save(second, folder / SHARD2)
    if weight_map is None:
        weight_map = {**{k: SHARD1 for k in first}, **{k: SHARD2 for k in second}}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _folder(pair, tmp_path: Path, case: str) -> Path:
    """A's folder made into `case` (the CASES below)."""
    a, ta, tb = pair
    folder = copy_of(a, tmp_path / case)
    if case == "single+backup":  # the review's case: another model's tensors beside model.safetensors
        _save(tb, folder / "model-backup.safetensors")
    elif case == "single+disjoint":  # a file of other tensors beside it: transformers never reads it
        _save({"extra.weight": torch.ones(3)}, folder / "adapter.safetensors")
    elif case == "single+index":  # model.safetensors (A) over an index of B's shards: transformers takes model.safetensors
        _shard(folder, tb)
    elif case == "index+backup":  # the index says which files hold the weights: a stray copy beside them is never read
        (folder / "model.safetensors").unlink()
        _shard(folder, ta)
        _save(tb, folder / "model-backup.safetensors")
    elif case == "index-omits-a-key":  # a shard's tensor the index does not name: transformers loads it all the same
        (folder / "model.safetensors").unlink()
        weight_map = {k: (SHARD1 if k < sorted(ta)[len(ta) // 2] else SHARD2) for k in ta if k != "lm_head.weight"}
        _shard(folder, ta, weight_map)
    elif case in ("index-names-the-copy-taken", "index-names-the-copy-not-taken"):
        (folder / "model.safetensors").unlink()
        _shard(folder, ta)
        key = sorted(ta)[0]  # in the first shard; the second gets B's copy, which transformers takes (the later file)
        _save({**load_file(folder / SHARD2), key: tb[key]}, folder / SHARD2)
        if case == "index-names-the-copy-taken":
            index = json.loads((folder / INDEX).read_text())
            index["weight_map"][key] = SHARD2
            (folder / INDEX).write_text(json.dumps(index))
    elif case == "config-names-the-file":  # config.json's transformers_weights: that file, whatever else is there
        _save(tb, folder / "other.safetensors")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": "other.safetensors"}))
    elif case == "no-file-transformers-reads":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    return folder


# case -> the files a refusal names (None: loads, the tensors transformers loads)
CASES = {
    "single+backup": ("model.safetensors", "model-backup.safetensors"),
    "single+disjoint": None,
    "single+index": ("model.safetensors", SHARD1),
    "index+backup": None,
    "index-omits-a-key": None,
    "index-names-the-copy-taken": None,
    "index-names-the-copy-not-taken": (SHARD1, SHARD2),
    "config-names-the-file": None,
    "no-file-transformers-reads": ("model-00001-of-00001.safetensors", "model.safetensors"),
}


def _transformers_loads(folder: Path) -> dict:
    """What transformers' own loader puts in the model: its state dict (None where it refuses the folder)."""
    try:
        model = LlamaForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except OSError:
        return None
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", ["streamed", "whole"])
def test_halfsafe_reads_the_tensors_transformers_loads_or_refuses_naming_both_files(pair, tmp_path, case, path):
    folder = _folder(pair, tmp_path, case)
    names = CASES[case]
    if names is not None:
        with pytest.raises(HalfsafeError) as e:
            load_model(folder, stream=path == "streamed")
        line = str(e.value)
        assert "\n" not in line and all(n in line for n in names), line
        return
    expected = _transformers_loads(folder)
    assert expected is not None
    model = load_model(folder, stream=path == "streamed").model
    streamed = streamed_of(model)
    if path == "streamed":
        assert streamed is not None  # streamed indeed: the tensors below are the ones it reads from the files
        read = {name: streamed.shards.load(key) for name, key in streamed.key_of.items()}
    else:
        assert streamed is None
        read = model.state_dict()
    assert set(read) <= set(expected) and read
    for name, t in read.items():
        assert torch.equal(t.float(), expected[name]), (case, name)


@pytest.mark.parametrize("case", [c for c, names in sorted(CASES.items()) if names is not None])
@pytest.mark.parametrize("command", ["scan", "convert", "verify"])
def test_the_cli_refuses_an_ambiguous_folder_before_loading_anything(pair, tmp_path, capsys, monkeypatch, case, command):
    """One line naming both files, exit 2, before any weight is loaded (no from_pretrained of a model), MODEL untouched."""
    from transformers import PreTrainedModel

    import halfsafe.io.loading as loading

    folder = _folder(pair, tmp_path, case)
    loaded, real = [], loading.from_pretrained
    monkeypatch.setattr(loading, "from_pretrained", lambda cls, *a, **k: (
        loaded.append(cls) if isinstance(cls, type) and issubclass(cls, PreTrainedModel) else None, real(cls, *a, **k))[1])
    before, out = folder_hash(folder), tmp_path / "out"
    argv = {"scan": ["scan", str(folder), *SHORT], "convert": ["convert", str(folder), str(out), *SHORT],
            "verify": ["verify", str(folder), "--seq-len", "32", "--max-samples", "1", "--greedy-tokens", "0"]}[command]
    refused(capsys, argv, *CASES[case])
    assert not loaded and not out.exists() and folder_hash(folder) == before


@pytest.mark.parametrize("case", ["single+backup", "single+index"])
def test_the_unread_file_is_never_opened_when_the_choice_is_clear(pair, tmp_path, case):
    """With the duplicate moved out, the folder loads: the refusal was about the copy, not about the files read."""
    folder = _folder(pair, tmp_path, case)
    for f in ("model-backup.safetensors", SHARD1, SHARD2, INDEX):
        if (folder / f).exists():
            (folder / f).unlink()
    assert load_model(folder, stream=True).model is not None


# ----- the fingerprint: which files of a folder halfsafe wrote are its weights ---------------------------------------


@pytest.fixture(scope="module")
def converted(pair, tmp_path_factory) -> Path:
    from halfsafe.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("fingerprinted") / "out"
    convert_checkpoint(str(pair[0]), str(out), seq_len=32, max_samples=1, progress=False)
    return out


@pytest.mark.parametrize("extra", ["model-backup.safetensors", "index+shards", "fifo", "fifo-over-model"])
def test_the_fingerprint_refuses_a_weight_file_it_did_not_cover(pair, converted, tmp_path, extra):
    """A folder halfsafe wrote, with another model's weights beside its own (a backup, an index and shards that a
    loader might take instead, a FIFO named like a weight file): not the folder halfsafe fingerprinted, in one line
    naming the file; without it, verified."""
    from halfsafe_serve.fingerprint import NotVerified, verified_record

    folder = tmp_path / "out"
    shutil.copytree(converted, folder)
    assert verified_record(folder)
    if extra == "index+shards":
        _shard(folder, pair[2])
        named = INDEX
    elif extra == "fifo":
        os.mkfifo(folder / "model-extra.safetensors")
        named = "model-extra.safetensors"
    elif extra == "fifo-over-model":  # in the record's own name: refused before anything is hashed
        (folder / "model.safetensors").unlink()
        os.mkfifo(folder / "model.safetensors")
        named = "model.safetensors"
    else:
        _save(pair[2], folder / extra)
        named = extra
    with pytest.raises(NotVerified) as e:
        returns_within(lambda: verified_record(folder), [folder / named])
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
