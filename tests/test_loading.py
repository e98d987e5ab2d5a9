"""Model sources other than a plain folder: a hub id already in the local cache (never downloaded)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny import save_tiny

from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import HalfsafeError
from halfsafe.io.loading import load_model


def test_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / "0123456789abcdef"
    save_tiny("llama", snapshot)
    (cache / "models--acme--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    loaded = load_model("acme/tiny-llama")
    assert loaded.model.config.model_type == "llama"
    assert loaded.folder == snapshot
    # a hub id is a folder like any other: streamed when asked, and its device checked where every source's is
    assert streamed_of(load_model("acme/tiny-llama", stream=True).model) is not None
    if not torch.cuda.is_available():
        with pytest.raises(HalfsafeError, match="no CUDA GPU"):
            load_model("acme/tiny-llama", device="cuda")

    shutil.rmtree(cache / "models--acme--tiny-llama")
    with pytest.raises(HalfsafeError, match="local Hugging Face cache"):
        load_model("acme/tiny-llama")


def test_a_hub_snapshot_whose_files_link_into_blobs_loads_and_nothing_outside_the_repository_does(tmp_path, monkeypatch):
    """The Hugging Face cache keeps a snapshot's files as links into the repository's blobs/: inside the trusted
    folder (the repository's). A link out of the repository is refused like any other."""
    from halfsafe.io.trust import inside, model_root

    repo = tmp_path / "hub" / "models--acme--linked"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    save_tiny("llama", tmp_path / "plain")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in (tmp_path / "plain").iterdir():
        blob = repo / "blobs" / f"sha-{f.name}"
        f.rename(blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert model_root(snapshot) == repo.resolve()
    assert load_model(snapshot).model.config.model_type == "llama"
    (tmp_path / "outside.json").write_text("{}")
    (snapshot / "tokenizer_config.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(HalfsafeError, match="outside the model folder"):
        load_model(snapshot)
    with pytest.raises(HalfsafeError, match="outside the model folder"):
        inside(snapshot, "../../../../outside.json")
