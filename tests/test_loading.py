"""Model sources other than a plain folder: a hub id already in the local cache (never downloaded)."""

from __future__ import annotations

import shutil

import pytest

from halfsafe.errors import HalfsafeError
from halfsafe.loading import load_model
from tiny import save_tiny


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

    shutil.rmtree(cache / "models--acme--tiny-llama")
    with pytest.raises(HalfsafeError, match="local Hugging Face cache"):
        load_model("acme/tiny-llama")
