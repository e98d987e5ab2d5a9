"""export/gguf.py without llama.cpp: the copy `prepare_for_llama_cpp` makes (1-D tensors widened exactly, every
other tensor the checkpoint's own bits), `compare_gguf` on a GGUF written here with the `gguf` package, and both
reading the checkpoint through the one reader of a model folder, so a file it names outside the folder is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_tiny

from halfsafe.errors import HalfsafeError
from halfsafe.export.gguf import compare_gguf, prepare_for_llama_cpp


@pytest.fixture
def half_folder(tmp_path):
    """A tiny Llama saved as float16, as `halfsafe convert` leaves it."""
    folder = tmp_path / "converted"
    make_tiny("llama").half().save_pretrained(folder)
    (folder / "README.md").write_text("card\n")
    return folder


def test_prepare_widens_only_1d_tensors_exactly_and_copies_the_rest(half_folder, tmp_path):
    out = prepare_for_llama_cpp(half_folder, tmp_path / "prepared")
    before, after = load_file(half_folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    for k, v in before.items():
        if v.dim() == 1:
            assert after[k].dtype == torch.float32 and torch.equal(after[k], v.float()), k
        else:
            assert after[k].dtype == v.dtype and torch.equal(after[k].view(torch.int16), v.view(torch.int16)), k
    assert (out / "README.md").read_text() == "card\n" and (out / "config.json").read_bytes() == (half_folder / "config.json").read_bytes()


def test_a_weight_file_named_outside_the_folder_is_refused(half_folder, tmp_path):
    """An index may name a shard by a path: it is resolved inside the folder, or refused before anything is read."""
    outside = tmp_path / "outside.safetensors"
    (half_folder / "model.safetensors").rename(outside)
    keys = list(load_file(outside))
    (half_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "../outside.safetensors" for k in keys}}))
    save_file({"decoy": torch.zeros(1)}, half_folder / "model-decoy.safetensors")  # so the folder still has weights
    for run in (lambda: prepare_for_llama_cpp(half_folder, tmp_path / "prepared"), lambda: compare_gguf(tmp_path / "x.gguf", half_folder)):
        with pytest.raises(HalfsafeError, match="outside the model folder"):
            run()
    assert not (tmp_path / "prepared" / "outside.safetensors").exists()


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(HalfsafeError, match="has no \\*.safetensors"):
        prepare_for_llama_cpp(tmp_path / "empty", tmp_path / "out")


def test_compare_gguf_reads_every_tensor_and_the_eps(half_folder, tmp_path):
    gguf = pytest.importorskip("gguf")
    config = json.loads((half_folder / "config.json").read_text())
    tensors = load_file(half_folder / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    for name, w in tensors.items():
        base = name.removesuffix(".weight").removeprefix("model.")
        value = w.float().numpy() if w.dim() == 1 else w.numpy()  # as llama.cpp's converter stores them
        writer.add_tensor(names.get_name(base) + ".weight", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = compare_gguf(tmp_path / "tiny.gguf", half_folder)
    assert got["arch"] == "llama" and got["eps_exact"]
    assert got["tensors_compared"] == len(tensors) == got["exact"] and not got["tensors_not_found"]
