"""export/gguf.py without llama.cpp: the copy `prepare_for_llama_cpp` makes (1-D tensors widened exactly, every
other tensor the checkpoint's own bits), `compare_gguf` on a GGUF written here with the `gguf` package, and both
reading the checkpoint through the one reader of a model folder, so a file it names outside the folder is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import llamaenv
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jsclient import save_char_tokenizer
from safetensors.torch import load_file, save_file
from tiny import make_tiny

from halfsafe.calibration import default_text
from halfsafe.cli import main
from halfsafe.convert import convert_checkpoint
from halfsafe.errors import HalfsafeError
from halfsafe.export.gguf import check_gguf_target, compare_gguf, export_gguf, prepare_for_llama_cpp


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


def _hand_gguf(path: Path, folder: Path, tensors: dict) -> Path:
    """A llama GGUF of `tensors` written with the `gguf` package, named and typed as llama.cpp's converter stores
    them (no rotary permutation: each tensor as is)."""
    gguf = pytest.importorskip("gguf")
    config = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    for name, w in tensors.items():
        base = name.removesuffix(".weight").removeprefix("model.")
        value = w.float().numpy() if w.dim() == 1 else w.numpy()  # as llama.cpp's converter stores them
        writer.add_tensor(names.get_name(base) + ".weight", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_compare_gguf_reads_every_tensor_and_the_eps(half_folder, tmp_path):
    tensors = load_file(half_folder / "model.safetensors")
    got = compare_gguf(_hand_gguf(tmp_path / "tiny.gguf", half_folder, tensors), half_folder)
    assert got["arch"] == "llama" and got["eps_exact"] and not got["gguf_unchecked"]
    assert got["tensors_compared"] == len(tensors) == got["exact"] and not got["tensors_not_found"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_compare_gguf_finds_any_one_value_changed(half_folder, tmp_path_factory, data):
    """Any one element of any tensor changed by any float16 bit pattern that is another value: that tensor, and only
    it, is not exact (what `export gguf` refuses on)."""
    tensors = load_file(half_folder / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
    flat = tensors[name].reshape(-1).clone()
    i = data.draw(st.integers(0, flat.numel() - 1), label="element")
    bits = data.draw(st.integers(0, 2**16 - 1), label="float16 bits")
    new = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).to(flat.dtype)
    assume(not torch.isnan(new).any() and new.item() != flat[i].item())
    flat[i] = new.item()
    changed = {**tensors, name: flat.reshape(tensors[name].shape)}
    got = compare_gguf(_hand_gguf(tmp_path_factory.mktemp("one") / "x.gguf", half_folder, changed), half_folder)
    assert [r["tensor"] for r in got["rows"] if not r["exact"]] == [name]


# ---------------------------------------------------------------------------------------------------------------------
# `halfsafe export gguf`: llama.cpp's own converter (scripts/setup-llama-cpp's pinned release), run by llama.cpp itself
# ---------------------------------------------------------------------------------------------------------------------

FAMILIES = ("llama", "gemma", "gemma2", "gemma3_text", "qwen2", "qwen3", "phi3")  # tiny models llama.cpp runs
NEW_TOKENS = 8
# llama.cpp's CPU arithmetic (activations rounded to float16 before each F16 product) against fp32: measured 1.5e-4
# (gemma) to 7.7e-4 (gemma3_text) on these prompts; a GGUF whose rope theta alone is off (1e4 -> 5e5) gives 2.1e-3 on llama
LOGIT_BOUND = 1.5e-3


@pytest.fixture(scope="module")
def llama_cpp():
    folder, why = llamaenv.environment()
    if folder is None:
        pytest.skip(why)
    return folder


@pytest.fixture(scope="module")
def converted(llama_cpp, tmp_path_factory):
    """key -> a tiny model saved in bf16 and converted by halfsafe (once per module), with a tokenizer.model that
    llama.cpp's converter reads."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = root / "tokenizer.model"
    llamaenv.sentencepiece_model(llama_cpp, tokenizer, default_text())
    made = {}

    def make(key: str) -> Path:
        if key not in made:
            _tiny(key).to(torch.bfloat16).save_pretrained(root / key / "original")
            convert_checkpoint(str(root / key / "original"), str(root / key / "converted"), seq_len=32, max_samples=2, progress=False)
            shutil.copy(tokenizer, root / key / "converted" / "tokenizer.model")
            made[key] = root / key / "converted"
        return made[key]

    return make


def _tiny(key: str):
    """tests/tiny's model; Gemma 3 with its real layer layout, five sliding-window blocks then a global one: llama.cpp
    (this release) reads no layer types from the GGUF and assumes that pattern, where tiny/gemma3.py alternates."""
    if key != "gemma3_text":
        return make_tiny(key)
    from tiny import TINY
    from vllmenv import randomised

    config = TINY[key]()
    config.num_hidden_layers, config.layer_types = 6, ["sliding_attention"] * 5 + ["full_attention"]
    return randomised(config)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (5, 9, 13)]


@torch.no_grad()
def _fp32_logits(folder: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers fp32 on the converted checkpoint's own weights (float16, widened exactly)."""
    from halfsafe.io.loading import model_class_for, read_config

    model = model_class_for(read_config(folder)).from_pretrained(folder, dtype=torch.float32).eval()
    return [model(torch.tensor([s])).logits[0].double() for s in sequences]


@pytest.mark.parametrize("key", FAMILIES)
def test_llama_cpp_runs_the_export_as_transformers_fp32(key, llama_cpp, converted, tmp_path):
    """The CLI's GGUF, loaded by llama.cpp (CPU): its logits on every prompt position and on each greedy step are
    transformers fp32's of the same converted weights to LOGIT_BOUND, and its greedy tokens are fp32's wherever
    fp32's top two are further apart than twice that (tiny random models have near-ties)."""
    folder = converted(key)
    out = tmp_path / f"{key}.gguf"
    assert main(["export", "gguf", str(folder), str(out), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["tensors"] == len(load_file(folder / "model.safetensors")) and not report["not_stored"]
    _runs_as_fp32(key, llama_cpp, folder, out)


def _runs_as_fp32(key: str, llama_cpp: Path, folder: Path, out: Path) -> None:
    prompts = _prompts(json.loads((folder / "config.json").read_text())["vocab_size"])
    got = llamaenv.run(llama_cpp, out, prompts, NEW_TOKENS)
    refs = _fp32_logits(folder, [p + g["greedy"] for p, g in zip(prompts, got)])
    checked = 0
    for prompt, run, ref in zip(prompts, got, refs):
        n = len(prompt)
        llama = torch.tensor(run["logits"] + run["greedy_logits"][1:], dtype=torch.float64)  # positions 0 .. n + NEW - 2
        assert torch.equal(torch.tensor(run["greedy_logits"][0]), torch.tensor(run["logits"][-1]))
        diff = (llama - ref[: n + NEW_TOKENS - 1, : llama.shape[1]]).abs().max().item()
        assert diff <= LOGIT_BOUND, f"{key}: llama.cpp's logits differ from fp32's by {diff:.3g}"
        for i, token in enumerate(run["greedy"]):
            top2 = ref[n - 1 + i].topk(2).values
            if top2[0] - top2[1] > 2 * LOGIT_BOUND:
                assert token == ref[n - 1 + i].argmax().item(), f"{key}: greedy token {i} of prompt {prompt}"
                checked += 1
    assert checked >= NEW_TOKENS, f"{key}: only {checked} greedy steps had a clear top-2 margin"


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_without_a_llama_cpp_the_export_is_one_line_naming_the_setup(half_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HALFSAFE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HALFSAFE_LLAMA_CPP_DIR", raising=False)
    before = _listing(tmp_path)
    assert main(["export", "gguf", str(half_folder), str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scripts/setup-llama-cpp" in err and "Traceback" not in err
    assert main(["export", "gguf", str(half_folder), str(tmp_path / "x.gguf"), "--llama-cpp", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "convert_hf_to_gguf.py" in err and "scripts/setup-llama-cpp" in err
    assert _listing(tmp_path) == before


def test_refusals_before_the_converter_runs(llama_cpp, converted, tmp_path, capsys, monkeypatch):
    """An existing OUT (a GGUF without --overwrite; anything else even with it), a folder halfsafe did not convert,
    a model type llama.cpp's converter does not know, a folder asking for its own code, --scan or --runtime (onnx's):
    one line each, exit 2, every file as it was."""
    folder = converted("llama")
    gguf = tmp_path / "old.gguf"
    gguf.write_bytes(b"GGUF old")
    other = tmp_path / "notes.txt"
    other.write_bytes(b"mine")
    (tmp_path / "gpt_neo").mkdir()
    make_tiny("gpt_neo").to(torch.bfloat16).save_pretrained(tmp_path / "gpt_neo" / "original")
    convert_checkpoint(str(tmp_path / "gpt_neo" / "original"), str(tmp_path / "gpt_neo" / "converted"), seq_len=32,
                       max_samples=2, progress=False)
    remote = shutil.copytree(folder, tmp_path / "remote")  # llama.cpp's converter loads tokenizers with trust_remote_code=True
    (remote / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.Tok", None]}}))
    (remote / "tok.py").write_text("raise SystemExit('ran code from the model folder')\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        ([str(folder), str(gguf)], "already exists"),
        ([str(folder), str(other), "--overwrite"], "not a GGUF file"),
        ([str(folder.parent / "original"), str(tmp_path / "a.gguf")], "has no halfsafe.json"),
        ([str(tmp_path / "gpt_neo" / "converted"), str(tmp_path / "b.gguf")], "does not know model_type 'gpt_neo'"),
        ([str(remote), str(tmp_path / "e.gguf")], "never runs code from a model folder"),
        ([str(folder), str(tmp_path / "c.gguf"), "--scan"], "--scan is for export onnx"),
        ([str(folder), str(tmp_path / "d.gguf"), "--runtime", "ort-webgpu"], "--runtime is for export onnx"),
        ([str(folder), str(folder / "inside.gguf")], "inside"),
    ]
    capsys.readouterr()  # the conversions' own output
    for args, says in cases:
        assert main(["export", "gguf", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, (args, err)
    import halfsafe.export.gguf as gguf_export

    def ran(*args, **kwargs):
        pytest.fail("llama.cpp's converter ran on a folder that asks for its own code")

    monkeypatch.setattr(gguf_export, "convert_with_llama_cpp", ran)
    with pytest.raises(HalfsafeError, match="never runs code from a model folder"):  # the API's own check, not the CLI's
        export_gguf(remote, tmp_path / "f.gguf")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_a_gguf_whole(llama_cpp, converted, tmp_path):
    folder = converted("qwen2")
    out = tmp_path / "q.gguf"
    out.write_bytes(b"GGUF from before")
    assert main(["export", "gguf", str(folder), str(out), "--overwrite"]) == 0
    assert compare_gguf(out, folder)["exact"] == len(load_file(folder / "model.safetensors"))
    assert _listing(tmp_path) == ["q.gguf"]


def test_a_converter_failure_leaves_nothing(llama_cpp, converted, tmp_path, capsys):
    """llama.cpp's converter fails (a tokenizer.model it cannot read): one line, exit 2, no OUT, no temporary file or
    folder beside it, the model folder as it was."""
    folder = tmp_path / "broken"
    shutil.copytree(converted("llama"), folder)
    (folder / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    before = {p: p.read_bytes() for p in folder.iterdir()}
    (tmp_path / "out").mkdir()
    capsys.readouterr()  # the conversion's own output
    assert main(["export", "gguf", str(folder), str(tmp_path / "out" / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "convert_hf_to_gguf.py" in err and "failed" in err, err
    assert _listing(tmp_path / "out") == [] and {p: p.read_bytes() for p in folder.iterdir()} == before


def test_a_gguf_with_tensors_halfsafe_cannot_compare_is_refused(llama_cpp, converted, tmp_path, capsys):
    """Mixtral: llama.cpp stacks the experts into one tensor per projection, which the read-back does not compare with
    the checkpoint's per-expert tensors: refused in one line, nothing written (not passed unchecked)."""
    (tmp_path / "out").mkdir()
    folder = converted("mixtral")
    capsys.readouterr()  # the conversion's own output
    assert main(["export", "gguf", str(folder), str(tmp_path / "out" / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot compare" in err and "_exps" in err and "nothing was written" in err, err
    assert _listing(tmp_path / "out") == []


def test_a_gguf_that_is_not_exact_is_refused_and_not_written(llama_cpp, converted, tmp_path, capsys, monkeypatch):
    """Without `prepare_for_llama_cpp` llama.cpp's converter adds Gemma's +1 to the float16 norm gains in float16 and
    rounds: the read-back names the tensor, and nothing is written."""
    import halfsafe.export.gguf as gguf_export

    monkeypatch.setattr(gguf_export, "prepare_for_llama_cpp", lambda src, dst: shutil.copytree(src, dst))
    (tmp_path / "out").mkdir()
    folder = converted("gemma")
    capsys.readouterr()  # the conversion's own output
    assert main(["export", "gguf", str(folder), str(tmp_path / "out" / "g.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not exact" in err and "norm.weight" in err and "nothing was written" in err, err
    assert _listing(tmp_path / "out") == []


def _original_with_tokenizer(root: Path) -> Path:
    """A tiny Llama in bf16 with a tokenizer both halfsafe (transformers) and llama.cpp's converter read: the
    character BPE of tests/jsclient.py marked byte-fallback, which the converter takes as a Llama tokenizer."""
    model = make_tiny("llama")
    model.to(torch.bfloat16).save_pretrained(root)
    save_char_tokenizer(root, model.config)
    tokenizer = json.loads((root / "tokenizer.json").read_text())
    tokenizer["model"]["byte_fallback"] = True
    (root / "tokenizer.json").write_text(json.dumps(tokenizer))
    return root


def test_convert_to_gguf_puts_the_gguf_in_out(llama_cpp, tmp_path):
    """`convert --to gguf`: OUT holds model-f16.gguf beside the weights, listed in its halfsafe.json (so --overwrite
    takes OUT again), every tensor exact, and llama.cpp runs it as transformers fp32 runs OUT's weights."""
    original = _original_with_tokenizer(tmp_path / "original")
    out = tmp_path / "out"
    args = ["convert", str(original), str(out), "--to", "gguf", "--seq-len", "32", "--max-samples", "2"]
    assert main(args) == 0
    assert "model-f16.gguf" in json.loads((out / "halfsafe.json").read_text())["files"]
    got = compare_gguf(out / "model-f16.gguf", out)
    assert got["exact"] == got["tensors_compared"] == len(load_file(out / "model.safetensors")) and not got["gguf_unchecked"]
    _runs_as_fp32("llama", llama_cpp, out, out / "model-f16.gguf")
    assert main([*args, "--overwrite"]) == 0 and (out / "model-f16.gguf").is_file()


def test_convert_to_gguf_refuses_before_converting(llama_cpp, tmp_path, capsys, monkeypatch):
    """An architecture llama.cpp's converter does not know, or no llama.cpp: one line, exit 2, before the conversion
    (no OUT, nothing beside it)."""
    make_tiny("gpt_neo").to(torch.bfloat16).save_pretrained(tmp_path / "gpt_neo")
    llama = _original_with_tokenizer(tmp_path / "llama")
    capsys.readouterr()
    before = _listing(tmp_path)
    assert main(["convert", str(tmp_path / "gpt_neo"), str(tmp_path / "out"), "--to", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not know GPTNeoForCausalLM" in err, err
    linked = tmp_path / "linked"  # the API's own check reads config.json only once it is a file inside the folder
    linked.mkdir()
    (linked / "config.json").symlink_to(tmp_path / "gpt_neo" / "config.json")
    with pytest.raises(HalfsafeError, match="outside the model folder"):
        check_gguf_target(linked)
    before = _listing(tmp_path)
    monkeypatch.setenv("HALFSAFE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HALFSAFE_LLAMA_CPP_DIR", raising=False)
    assert main(["convert", str(llama), str(tmp_path / "out"), "--to", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scripts/setup-llama-cpp" in err, err
    assert _listing(tmp_path) == before


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_compare_gguf_finds_a_tensor_cut_short(half_folder, tmp_path_factory, data):
    """Only the embedding may lose rows (llama.cpp drops Gemma's unused vocabulary): any other tensor stored with its
    last row (or element) missing is not exact, though every value it holds is."""
    tensors = load_file(half_folder / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(k for k in tensors if "embed_tokens" not in k)), label="tensor")
    cut = {**tensors, name: tensors[name][:-1].contiguous()}
    got = compare_gguf(_hand_gguf(tmp_path_factory.mktemp("cut") / "x.gguf", half_folder, cut), half_folder)
    assert [r["tensor"] for r in got["rows"] if not r["exact"]] == [name]


# ---------------------------------------------------------------------------------------------------------------------
# What llama.cpp assumes without reading config.json: which blocks attend through a sliding window, Gemma's scale
# ---------------------------------------------------------------------------------------------------------------------

def _gemma3(layer_types: list[str], **fields):
    from tiny import TINY

    config = TINY["gemma3_text"]()
    config.num_hidden_layers, config.layer_types = len(layer_types), layer_types
    for k, v in fields.items():
        setattr(config, k, v)
    return config


def _llama_cpp_gemma3_layout(n: int, period: int = 6) -> list[str]:
    """llama.cpp's Gemma 3 without a pattern in the GGUF (src/models/gemma3.cpp, load_swa_pattern(ml, 6)): the last
    block of every six global, the others sliding."""
    return ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(n)]


def _layer_types(period: int):
    """llama.cpp's layout for 1 to 14 blocks with any set of blocks flipped (none: the layout itself)."""
    flip = {"sliding_attention": "full_attention", "full_attention": "sliding_attention"}

    @st.composite
    def draw(draw):
        layout = _llama_cpp_gemma3_layout(draw(st.integers(1, 14)), period)
        flips = draw(st.sets(st.integers(0, len(layout) - 1), max_size=len(layout)))
        return [flip[t] if i in flips else t for i, t in enumerate(layout)]

    return draw()


@settings(max_examples=60, deadline=None)
@given(types=_layer_types(6))
def test_gemma3_layer_types_other_than_llama_cpps_are_named(types):
    """Any Gemma 3 layer_types: no difference exactly where they are llama.cpp's fixed layout, before the converter runs
    and as a GGUF without a pattern reads back; a GGUF recording the layout block by block matches any of them."""
    from halfsafe.export.gguf import llama_cpp_differences

    config = _gemma3(types)
    same = types == _llama_cpp_gemma3_layout(len(types))
    assert (llama_cpp_differences(config) == []) == same
    assert (llama_cpp_differences(config, {"arch": "gemma3", "window": 8, "pattern": None}) == []) == same
    flags = [t == "sliding_attention" for t in types]
    assert llama_cpp_differences(config, {"arch": "gemma3", "window": 8, "pattern": flags}) == []
    assert (llama_cpp_differences(config, {"arch": "gemma3", "window": 0, "pattern": flags}) == []) == (not any(flags))
    assert (llama_cpp_differences(config, {"arch": "gemma3", "window": 9, "pattern": flags}) == []) == (not any(flags))


@settings(max_examples=40, deadline=None)
@given(types=_layer_types(2))
def test_gemma2_layer_types_other_than_alternating_are_named(types):
    """llama.cpp's Gemma 2 (src/models/gemma2.cpp, load_swa_pattern(ml, 2)): sliding, global, sliding, ..."""
    from tiny import TINY

    from halfsafe.export.gguf import llama_cpp_differences

    config = TINY["gemma2"]()
    config.num_hidden_layers, config.layer_types = len(types), types
    same = types == _llama_cpp_gemma3_layout(len(types), period=2)
    assert (llama_cpp_differences(config) == []) == same
    assert (llama_cpp_differences(config, {"arch": "gemma2", "window": 8, "pattern": None}) == []) == same
    # no window in the GGUF: llama.cpp's 4096, which never binds within max_position_embeddings 128
    no_window = llama_cpp_differences(config, {"arch": "gemma2", "window": None, "pattern": None})
    assert (no_window == []) == all(t == "full_attention" for t in types)


@pytest.mark.parametrize("key, fields, says", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "[full, window 16]"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "[window 16, window 16]"),
    ("phi3", {"sliding_window": 16}, "llama.cpp's phi3 assumes [full, full]"),
    ("mistral", {"sliding_window": 16}, "[window 16, window 16]"),
    ("gemma3_text", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar 32"),
    ("gemma2", {"query_pre_attn_scalar": 8}, "query_pre_attn_scalar 8"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional"),
])
def test_what_llama_cpp_would_assume_otherwise_is_named(key, fields, says):
    """Qwen2/3 with a sliding window (llama.cpp reads none), Phi-3's (read, then switched off), Mistral's (converted as
    llama), Gemma's attention scale (not in the GGUF) and Gemma 3's bidirectional attention; a window no shorter than
    max_position_embeddings never binds and is no difference."""
    from tiny import TINY

    from halfsafe.export.gguf import llama_cpp_differences

    config = _gemma3(_llama_cpp_gemma3_layout(6)) if key == "gemma3_text" else TINY[key]()
    if key == "mistral":  # tests/tiny's has one
        config.sliding_window = None
    assert llama_cpp_differences(config) == []
    for k, v in fields.items():
        setattr(config, k, v)
    if key.startswith("qwen"):  # transformers derives layer_types from these at construction
        config = type(config)(**{**config.to_dict(), "layer_types": None})
    found = llama_cpp_differences(config)
    assert len(found) == 1 and says in found[0], found
    if "sliding_window" in fields and key != "qwen2" and key != "qwen3":
        config.sliding_window = config.max_position_embeddings
        assert llama_cpp_differences(config) == []


def test_a_gemma3_in_another_layout_is_refused_before_the_converter_runs(llama_cpp, converted, tmp_path, capsys, monkeypatch):
    """tests/tiny's Gemma 3 alternates sliding and global blocks; llama.cpp would run its block 1 through the window:
    one line naming the layer layout, exit 2, nothing written, the converter never run (export gguf and the API);
    the same layout as llama.cpp's (the 6-block tiny) exports, and its GGUF reads back no pattern of its own."""
    import halfsafe.export.gguf as gguf_export

    (tmp_path / "src").mkdir()
    make_tiny("gemma3_text").to(torch.bfloat16).save_pretrained(tmp_path / "src" / "original")
    convert_checkpoint(str(tmp_path / "src" / "original"), str(tmp_path / "src" / "converted"), seq_len=32,
                       max_samples=2, progress=False)
    folder = tmp_path / "src" / "converted"
    (tmp_path / "out").mkdir()
    capsys.readouterr()  # the conversion's own output

    def ran(*args, **kwargs):
        pytest.fail("llama.cpp's converter ran on a Gemma 3 whose layout llama.cpp would not compute")

    monkeypatch.setattr(gguf_export, "convert_with_llama_cpp", ran)
    assert main(["export", "gguf", str(folder), str(tmp_path / "out" / "g.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "[window 8, full]" in err and "assumes [window 8, window 8]" in err and "llama.cpp" in err, err
    with pytest.raises(HalfsafeError, match="block 1 first"):
        export_gguf(folder, tmp_path / "out" / "g.gguf")
    assert _listing(tmp_path / "out") == []
    monkeypatch.undo()
    good = converted("gemma3_text")
    assert main(["export", "gguf", str(good), str(tmp_path / "out" / "g.gguf")]) == 0
    assert gguf_export.gguf_attention(tmp_path / "out" / "g.gguf") == {"arch": "gemma3", "window": 8, "pattern": None}


def test_a_gguf_recording_another_layout_is_refused_on_read_back(llama_cpp, converted, tmp_path, capsys, monkeypatch):
    """The read-back checks what the GGUF records, not only what the converter is expected to write: a converter that
    writes a window of 4 for the 6-block Gemma 3 (config.json: 8) is refused and nothing is written."""
    import halfsafe.export.gguf as gguf_export

    real = gguf_export.convert_with_llama_cpp
    folder = converted("gemma3_text")

    def narrower(prepared, tmp, *args, **kwargs):
        config = json.loads((Path(prepared) / "config.json").read_text())
        (Path(prepared) / "config.json").write_text(json.dumps({**config, "sliding_window": 4}))
        return real(prepared, tmp, *args, **kwargs)

    monkeypatch.setattr(gguf_export, "convert_with_llama_cpp", narrower)
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    assert main(["export", "gguf", str(folder), str(tmp_path / "out" / "g.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "window 4" in err and "llama.cpp" in err, err
    assert _listing(tmp_path / "out") == []


def test_convert_to_gguf_refuses_a_layout_llama_cpp_would_not_compute_before_converting(llama_cpp, tmp_path, capsys,
                                                                                       monkeypatch):
    """`convert --to gguf` of the alternating tiny Gemma 3: one line naming the layout, exit 2, before the conversion."""
    import halfsafe.convert

    make_tiny("gemma3_text").to(torch.bfloat16).save_pretrained(tmp_path / "gemma3")
    monkeypatch.setattr(halfsafe.convert, "run_convert", lambda *a, **k: pytest.fail("converted before refusing"))
    capsys.readouterr()
    before = _listing(tmp_path)
    assert main(["convert", str(tmp_path / "gemma3"), str(tmp_path / "out"), "--to", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[window 8, full]" in err and "llama.cpp would compute another function" in err, err
    assert _listing(tmp_path) == before
