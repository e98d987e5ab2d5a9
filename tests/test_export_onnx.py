"""`halfsafe export onnx` / `convert --to onnx`: an fp16 ONNX graph of the converted checkpoint, checked for real.

Tiny random models blown past fp16's range (as in test_families), saved as bf16 checkpoints, converted with
halfsafe, then exported. ONNX Runtime's CPU provider computes fp16 ops in fp32, so overflow is checked with
onnx's reference evaluator, which computes fp16 ops in fp16 (numpy).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import jsclient  # noqa: E402
import onnx  # noqa: E402
from jsclient import save_char_tokenizer  # noqa: E402
from tiny import make_tiny, save_tiny, tiny_ids  # noqa: E402

from halfsafe.calibration import heldout_text, make_samples  # noqa: E402
from halfsafe.cli import main  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.core.groups import expand  # noqa: E402
from halfsafe.core.metrics import mean_kl  # noqa: E402
from halfsafe.core.probe import probe  # noqa: E402
from halfsafe.core.rewrite import apply_exponents_  # noqa: E402
from halfsafe.core.sites import find_blocks  # noqa: E402
from halfsafe.errors import UnsupportedModelError  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx, report_for  # noqa: E402
from halfsafe.export.onnx_clamps import add_residual_clamps, residual_adds  # noqa: E402
from halfsafe.export.onnx_common import inspect_file  # noqa: E402
from halfsafe.export.onnx_runners import OnnxDecoder  # noqa: E402
from halfsafe.export.onnx_seq2seq import DECODER_FILE, ENCODER_FILE  # noqa: E402
from halfsafe.families import family_for  # noqa: E402
from halfsafe.scan import scan  # noqa: E402

GREEDY = 24  # tokens generated with the KV cache (past the tiny Gemma 3's sliding window of 8)


def _stress_folder(key: str, folder):
    """A tiny model whose residual stream is blown up to ~4x 65504 by an exact rescale, saved in bf16."""
    model = make_tiny(key, untie=True)
    ids = tiny_ids(model, length=16)
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    modules = dict(model.named_modules())
    moved = probe(model, family, groups, ids)
    residual = {g.name for g in groups if g.block is None or any(
        s.endswith(":in") and "norm" in type(modules[s.rsplit(":", 1)[0]]).__name__.lower() for s in moved[g.name])}
    peak = max(layer.residual_peak for layer in scan(model, [ids], progress=False).layers)
    apply_exponents_(model, family, groups, {g: math.ceil(math.log2(4 * 65504 / peak)) for g in residual})
    model.to(torch.bfloat16).save_pretrained(folder)
    save_char_tokenizer(folder, model.config)  # for transformers.js's pipeline (test_transformers_js_*)
    return model.float()


def assert_greedy_equal(fp32, ids: torch.Tensor, got: list[int], want: list[int], tie: float = 1e-3) -> None:
    """`got` == `want` (fp32's greedy tokens after `ids`), or they part where fp32's two best logits are within
    `tie` (a random tiny model has such near-ties; fp16 arithmetic cannot break them as fp32 does), equal before it."""
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.no_grad():
        logits = fp32(torch.cat([ids, torch.tensor([want[:i]], dtype=ids.dtype)], dim=1)).logits[0, -1]
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    assert gap < tie and got[i] in top.indices.tolist(), f"greedy tokens part at {i}: {got[i]} != {want[i]} (fp32 top-2 gap {gap:.2e})"


def _heldout_ids(model, n: int = 32) -> torch.Tensor:
    return make_samples([heldout_text()], None, model.config.vocab_size, n, 1)[0]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Original (blown up, not converted) and converted tiny Gemma 3, each exported to fp16 ONNX."""
    root = tmp_path_factory.mktemp("gemma3")
    model = _stress_folder("gemma3_text", root / "original")
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=64, max_samples=4, progress=False)
    reports = {"original": export_onnx(root / "original", root / "original-onnx"),
               "converted": export_onnx(root / "converted", root / "converted-onnx")}
    return root, model, reports


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A blown-up tiny Llama converted and exported in one command: `halfsafe convert --to onnx`."""
    root = tmp_path_factory.mktemp("llama")
    model = _stress_folder("llama", root / "original")
    assert main(["convert", str(root / "original"), str(root / "converted"), "--seq-len", "64", "--max-samples", "4", "--to", "onnx"]) == 0
    return root, model


def test_layout_no_clip_fp16_weights_kv_cache(gemma3, llama):
    for folder in (gemma3[0] / "converted-onnx", llama[0] / "converted"):
        path = folder / ONNX_FILE
        info = inspect_file(path)
        assert info["clip_nodes"] == 0
        config = json.loads((folder / "config.json").read_text())
        assert config["transformers.js_config"]["dtype"] == "fp16"
        assert (folder / "halfsafe.json").is_file() and (folder / "generation_config.json").is_file()
        layers = config["num_hidden_layers"]
        assert info["inputs"] == ["input_ids", "attention_mask", "position_ids",
                                  *[f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]]
        assert info["outputs"] == ["logits", *[f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]]
        proto = onnx.load(str(path))
        mats = [i for i in proto.graph.initializer if len(i.dims) == 2]
        assert mats and all(i.data_type == onnx.TensorProto.FLOAT16 for i in mats)  # every weight matrix is fp16
        assert proto.graph.input[3].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16  # fp16 KV cache
        assert config["transformers.js_config"]["kv_cache_dtype"] == {"fp16": "float16"}  # 3.x makes the empty cache so
        # the free dimensions by the names transformers.js 4.x builds the empty KV cache from
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(proto.graph.input) + list(proto.graph.output)}
        _, heads, _, head_dim = dims["past_key_values.0.key"]
        assert dims["input_ids"] == dims["position_ids"] == ["batch_size", "sequence_length"]
        assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
        assert dims["past_key_values.1.value"] == ["batch_size", heads, "past_sequence_length", head_dim]
        assert dims["present.1.value"] == ["batch_size", heads, "total_sequence_length", head_dim]
        assert dims["logits"] == ["batch_size", "sequence_length", config["vocab_size"]]
        # float32 logits (Node has no Float16Array), cast from the fp16 graph's
        logits = proto.graph.output[0]
        assert logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        cast = next(n for n in proto.graph.node if logits.name in n.output)
        assert cast.op_type == "Cast"
        internal = {v.name: v.type.tensor_type.elem_type for v in proto.graph.value_info}
        assert internal[cast.input[0]] == onnx.TensorProto.FLOAT16
        assert not any(d.dim_param.startswith("s") and d.dim_param[1:].isdigit()
                       for v in proto.graph.value_info for d in v.type.tensor_type.shape.dim)  # no torch symbols left
    assert not any((gemma3[0] / "converted-onnx").glob("*.safetensors"))  # export onnx: no torch weights
    assert any((llama[0] / "converted").glob("*.safetensors"))  # convert --to onnx: both, side by side


@pytest.mark.parametrize("which", ["gemma3", "llama"])
def test_ort_greedy_matches_transformers_fp32(which, request):
    root, *_ = request.getfixturevalue(which)
    folder = root / ("converted-onnx" if which == "gemma3" else "converted")
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(root / "converted", dtype=torch.float32).eval()
    ids = _heldout_ids(fp32, 16)
    with torch.no_grad():
        want = fp32.generate(ids, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False)[0, ids.shape[1]:].tolist()
    got = OnnxDecoder(folder / ONNX_FILE).greedy(ids, GREEDY)
    assert_greedy_equal(fp32, ids, got, want)


def test_true_fp16_original_overflows_converted_matches_pytorch_fp16(gemma3):
    root, model, _ = gemma3
    ids = _heldout_ids(model, 32)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ref = model(ids).logits.double()  # the blown-up original in fp32: the reference
        conv16 = AutoModelForCausalLM.from_pretrained(root / "converted", dtype=torch.float16).eval()
        torch_kl = mean_kl(ref, conv16(ids).logits.double())
    original = OnnxDecoder(root / "original-onnx" / ONNX_FILE, backend="reference").logits(ids)
    assert not np.isfinite(original).all()
    converted = OnnxDecoder(root / "converted-onnx" / ONNX_FILE, backend="reference").logits(ids)
    assert converted.dtype == np.float32 and np.isfinite(converted).all()  # fp16 logits, cast at the end
    kl = mean_kl(ref, torch.from_numpy(converted).double())
    # measured: ONNX fp16 (reference evaluator) 2.5e-8, PyTorch fp16 2.2e-8, ORT 7.4e-9, bf16 1.2e-6 nats/token
    assert kl < 3 * torch_kl + 1e-9, (kl, torch_kl)
    # ORT (fp32 arithmetic inside) agrees too
    ort = OnnxDecoder(root / "converted-onnx" / ONNX_FILE).logits(ids)
    assert mean_kl(ref, torch.from_numpy(ort).double()) < 3 * torch_kl + 1e-9


def test_clamped_baseline_is_finite_but_wrong(gemma3):
    root, model, _ = gemma3
    ids = _heldout_ids(model, 32)
    proto = onnx.load(str(root / "original-onnx" / ONNX_FILE))
    blocks = find_blocks(model)
    assert len(residual_adds(proto, blocks)) == 2 * len(blocks)
    clamped = add_residual_clamps(proto, blocks)
    assert sum(n.op_type == "Clip" for n in clamped.graph.node) == 2 * len(blocks)
    logits = OnnxDecoder(clamped, backend="reference").logits(ids)
    assert np.isfinite(logits).all()
    with torch.no_grad():
        ref = model(ids).logits.double()
    kl = mean_kl(ref, torch.from_numpy(logits).double())
    assert kl > 1e-3, kl  # measured 2.2e-2 (converted: 2.5e-8): clamping changes the function


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


def test_unconverted_folder_warns(gemma3, caplog, monkeypatch, tmp_path):
    root, _, reports = gemma3
    assert reports["converted"].warning is None and reports["converted"].converted
    assert "no halfsafe.json" in reports["original"].warning and not reports["original"].converted
    # the warning comes before the slow export; stop there
    import halfsafe.export.onnx_decoder as decoder

    monkeypatch.setattr(decoder, "load_fp16", _stop)
    with caplog.at_level(logging.WARNING), pytest.raises(_Stop):
        export_onnx(root / "original", tmp_path / "warned", scan=True)
    text = caplog.text
    assert "no halfsafe.json" in text and "may overflow" in text and "halfsafe scan" in text
    assert "overflows fp16's 65504" in text  # --scan: what scan reports, on the blown-up original
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(_Stop):
        export_onnx(root / "converted", tmp_path / "quiet", scan=True)
    assert "halfsafe.json" not in caplog.text


def test_bad_input(tmp_path, gemma3, capsys, monkeypatch):
    root, *_ = gemma3
    assert main(["export", "onnx", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", "onnx", str(root / "converted"), str(root / "converted-onnx")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    save_tiny("t5gemma", tmp_path / "t5gemma")  # an encoder-decoder family transformers.js has no layout for
    with pytest.raises(UnsupportedModelError, match="OnnxExporter.*does not cover.*exports bart, mt5, pegasus, t5"):
        export_onnx(tmp_path / "t5gemma", tmp_path / "t5gemma-onnx")
    # convert --to onnx refuses it before converting: nothing written
    assert main(["convert", str(tmp_path / "t5gemma"), str(tmp_path / "t5gemma-out"), "--to", "onnx"]) == 2
    assert "does not cover" in capsys.readouterr().err and not (tmp_path / "t5gemma-out").exists()
    save_tiny("llama", tmp_path / "llama-cls")  # a decoder with a classifier head: no text generation
    config = json.loads((tmp_path / "llama-cls" / "config.json").read_text())
    (tmp_path / "llama-cls" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    assert main(["export", "onnx", str(tmp_path / "llama-cls"), str(tmp_path / "llama-cls-onnx")]) == 2
    err = capsys.readouterr().err
    assert "OnnxExporter" in err and "not a causal LM" in err
    # an architecture the exporter fails on: one line naming the exporter, no OUT left behind
    from transformers.exporters import OnnxExporter

    def fail(*a, **k):
        raise RuntimeError("Cannot trace data-dependent control flow\n  (a long traceback follows)")

    monkeypatch.setattr(OnnxExporter, "export", fail)
    assert main(["export", "onnx", str(root / "converted"), str(tmp_path / "fails")]) == 2
    err = capsys.readouterr().err
    assert "OnnxExporter (torch.onnx dynamo) could not export gemma3_text (RuntimeError: Cannot trace" in " ".join(err.split())
    assert "traceback" not in err
    assert not any(tmp_path.glob("*onnx")) and not (tmp_path / "fails").exists()


# ----------------------------------------------------------------------------------------------------------------
# The real client: transformers.js 3.x and 4.x in Node (clients/js), loading the exported folder with no options
# ----------------------------------------------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog"  # 44 tokens with <bos>: past the tiny Gemma 3's sliding window
needs_node = pytest.mark.skipif(jsclient.node_missing() is not None, reason=str(jsclient.node_missing()))


def _exported(which: str, root):
    return root / ("converted-onnx" if which == "gemma3" else "converted")


def _fp32_reference(root, new_tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "converted")
    fp32 = AutoModelForCausalLM.from_pretrained(root / "converted", dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = fp32.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        logits = fp32(ids).logits.double()
    return fp32, tokenizer, ids, want, logits


@needs_node
@pytest.mark.parametrize("lib", jsclient.VERSIONS)
@pytest.mark.parametrize("which", ["gemma3", "llama"])
def test_transformers_js_matches_transformers_fp32(which, lib, request, tmp_path):
    """pipeline('text-generation') and AutoModelForCausalLM.generate in Node: the prompt encoded as transformers
    encodes it (<bos> included), greedy tokens = transformers fp32, finite float32 logits close to fp32's."""
    root, *_ = request.getfixturevalue(which)
    fp32, tokenizer, ids, want, ref = _fp32_reference(root, GREEDY)
    got = jsclient.run(_exported(which, root), lib, prompt=PROMPT, ids=ids[0].tolist(), new_tokens=GREEDY,
                       logits_out=tmp_path / "logits.f32")
    assert got["prompt_ids"] == ids[0].tolist()
    assert_greedy_equal(fp32, ids, got["generate_ids"], want)
    assert got["pipeline_text"] == tokenizer.decode(got["generate_ids"], skip_special_tokens=True)
    assert got["logits"]["dtype"] == "float32" and got["logits"]["finite"]
    logits = np.fromfile(tmp_path / "logits.f32", np.float32).reshape(got["logits"]["dims"])
    assert mean_kl(ref, torch.from_numpy(logits).double()) < 1e-6  # measured 4e-9 (tiny Gemma 3, both versions)


def test_transformers_js_external_data(llama, tmp_path, monkeypatch):
    """Weights over the protobuf limit go to `model_fp16.onnx_data`, named in config.json: both versions load it."""
    import onnx_ir

    from halfsafe.export import onnx_common, onnx_folder

    root, _ = llama
    source = root / "converted"
    folder = tmp_path / "external"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "onnx"))
    monkeypatch.setattr(onnx_common, "INLINE_LIMIT", 0)  # as if the weights were over 2 GB
    onnx_common.save_program(onnx_ir.load(str(source / ONNX_FILE)), folder / ONNX_FILE)
    onnx_folder.mark_config(folder, external=(folder / (ONNX_FILE + "_data")).is_file())
    info = inspect_file(folder / ONNX_FILE)
    assert info["external_data"] and (folder / (ONNX_FILE + "_data")).stat().st_size > info["fp16_weight_bytes"] // 2
    config = json.loads((folder / "config.json").read_text())
    assert config["transformers.js_config"]["use_external_data_format"] == {"model_fp16.onnx": True}
    if jsclient.node_missing():
        pytest.skip(jsclient.node_missing())
    ids = tiny_ids(make_tiny("llama"), 12)[0].tolist()
    for lib in jsclient.VERSIONS:
        inline = jsclient.run(source, lib, ids=ids, new_tokens=8)
        external = jsclient.run(folder, lib, ids=ids, new_tokens=8)
        assert external["generate_ids"] == inline["generate_ids"] and external["logits"]["finite"]


@pytest.mark.skipif(jsclient.chromium_missing() is not None, reason=str(jsclient.chromium_missing()))
@pytest.mark.parametrize("lib", jsclient.VERSIONS)
def test_web_page_in_headless_chromium(gemma3, lib):
    """examples/web served from localhost: transformers.js (from node_modules) runs the exported folder in Chromium
    on the WASM backend; the prompt's tokens and the greedy text equal transformers fp32's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "web"))
    from serve import serve_in_thread

    root, *_ = gemma3
    _, tokenizer, ids, want, _ = _fp32_reference(root, 16)
    server, url = serve_in_thread(root / "converted-onnx")
    try:
        query = urllib.parse.urlencode({"lib": lib, "device": "wasm", "prompt": PROMPT, "tokens": 16})
        got = jsclient.browser(f"{url}?{query}")
    finally:
        server.shutdown()
    result = got["result"]
    assert "error" not in result, (result, got["logs"][-5:])
    assert result["device"] == "wasm" and result["version"] == {"tjs3": "3.8.1", "tjs4": "4.3.2"}[lib]
    assert result["prompt_ids"] == ids[0].tolist()
    assert result["text"] == tokenizer.decode(want, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------------
# Encoder-decoder models in transformers.js's layout (encoder_model + decoder_model_merged): T5 v1.1, BART, Pegasus
# ----------------------------------------------------------------------------------------------------------------

SEQ2SEQ_PROMPT = "translate: the quick brown fox"
SEQ2SEQ = ("t5-v1_1", "bart", "pegasus")  # tiny config keys
# Clip nodes in the encoder: Pegasus's encoder layers clamp to +-64504 in fp16 in transformers' own code, one per layer
ENCODER_CLIPS = {"t5-v1_1": 0, "bart": 0, "pegasus": 2}


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    """key -> (root, folder, report): a tiny encoder-decoder, converted by halfsafe and exported (built on first use):
    T5 by `halfsafe convert --to onnx` (weights and ONNX side by side in root/converted), BART and Pegasus by
    `halfsafe export onnx` (ONNX only, root/converted-onnx). The random heads favour the pad token by many nats
    everywhere; that row is zeroed so that greedy decoding picks other tokens."""
    built = {}

    def get(key: str):
        if key not in built:
            root = tmp_path_factory.mktemp(key)
            model = make_tiny(key)
            with torch.no_grad():
                model.get_output_embeddings().weight[model.config.pad_token_id] = 0
            model.to(torch.bfloat16).save_pretrained(root / "original")
            save_char_tokenizer(root / "original", model.config)
            if key == "t5-v1_1":
                assert main(["convert", str(root / "original"), str(root / "converted"), "--seq-len", "32",
                             "--max-samples", "2", "--to", "onnx"]) == 0
                folder = root / "converted"
                report = report_for(folder / DECODER_FILE, key, converted=(folder / "halfsafe.json").is_file())
            else:
                convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
                folder = root / "converted-onnx"
                report = export_onnx(root / "converted", folder)
            built[key] = root, folder, report
        return built[key]

    return get


@pytest.mark.parametrize("key", SEQ2SEQ)
def test_seq2seq_layout(seq2seq, key):
    root, folder, report = seq2seq(key)
    from halfsafe.export.onnx_seq2seq import kv_shape

    assert report.path == str(folder / DECODER_FILE) and report.clip_nodes == 0 and report.converted
    # export onnx: no torch weights; convert --to onnx (T5): the two graphs beside the weights
    assert any(folder.glob("*.safetensors")) == (key == "t5-v1_1") and (folder / "halfsafe.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["transformers.js_config"] == {"dtype": "fp16", "kv_cache_dtype": {"fp16": "float16"}}
    from halfsafe.io.loading import read_config

    layers = kv_shape(read_config(folder))[0]
    encoder = inspect_file(folder / ENCODER_FILE)
    assert encoder["inputs"] == ["input_ids", "attention_mask"] and encoder["outputs"] == ["last_hidden_state"]
    assert encoder["clip_nodes"] == ENCODER_CLIPS[key]
    assert report.inputs == ["input_ids", "encoder_attention_mask", "encoder_hidden_states",
                             *[f"past_key_values.{i}.decoder.{kv}" for i in range(layers) for kv in ("key", "value")]]
    assert report.outputs == ["logits", *[f"present.{i}.{part}.{kv}" for part in ("decoder", "encoder") for i in range(layers)
                                          for kv in ("key", "value")]]
    proto = onnx.load(str(folder / DECODER_FILE))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in list(proto.graph.input) + list(proto.graph.output)}
    assert dims["past_key_values.1.decoder.key"][0] == "batch_size" and dims["present.0.encoder.value"][2] == "encoder_sequence_length"
    assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    card = (folder / "README.md").read_text()
    assert ("load it with plain transformers" in card) == (key == "t5-v1_1")  # only beside torch weights
    assert ("has no model class for pegasus" in card) == (key == "pegasus")
    assert ("no Clip nodes" in card) == (key != "pegasus") and ("2 Clip nodes" in card) == (key == "pegasus")
    assert ("pipeline('text2text-generation'" in card) == (key != "pegasus")


@pytest.mark.parametrize("key", SEQ2SEQ)
def test_ort_seq2seq_greedy_matches_transformers_fp32(seq2seq, key):
    """The two graphs in ONNX Runtime (encoder once, decoder with its KV cache) = transformers fp32's greedy tokens
    (each step's argmax over the whole sequence so far, no cache), and each step's logits close to fp32's."""
    from transformers import AutoModelForSeq2SeqLM

    from halfsafe.export.onnx_runners import OnnxSeq2Seq

    root, folder, _ = seq2seq(key)
    fp32 = AutoModelForSeq2SeqLM.from_pretrained(root / "converted", dtype=torch.float32).eval()
    ids = tiny_ids(fp32, 12)
    start = fp32.config.decoder_start_token_id
    seq, ref = [start], []
    with torch.no_grad():
        for _ in range(GREEDY):
            ref.append(fp32(input_ids=ids, decoder_input_ids=torch.tensor([seq])).logits[0, -1].double())
            seq.append(int(ref[-1].argmax()))
    tokens, logits = OnnxSeq2Seq(folder).greedy(ids, start, GREEDY)
    assert tokens == seq[1:] and np.isfinite(logits).all()
    kl = mean_kl(torch.stack(ref)[None], torch.from_numpy(logits).double()[None])
    assert kl < 5e-6, kl  # measured 8.6e-7 (T5 v1.1), 1.3e-12 (BART), 4.5e-12 (Pegasus)


@needs_node
@pytest.mark.parametrize("lib", jsclient.VERSIONS)
@pytest.mark.parametrize("key", ["t5-v1_1", "bart"])  # transformers.js has no Pegasus class
def test_transformers_js_seq2seq_matches_transformers_fp32(seq2seq, key, lib, tmp_path):
    """pipeline('text2text-generation') and generate() of the exported model in Node = transformers fp32."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    root, folder, _ = seq2seq(key)
    tokenizer = AutoTokenizer.from_pretrained(root / "converted")
    fp32 = AutoModelForSeq2SeqLM.from_pretrained(root / "converted", dtype=torch.float32).eval()
    ids = tokenizer(SEQ2SEQ_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = fp32.generate(ids, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False)
        ref = fp32(input_ids=ids, decoder_input_ids=want).logits.double()
    assert len(set(want[0].tolist())) > 1  # not the pad token throughout
    got = jsclient.run(folder, lib, prompt=SEQ2SEQ_PROMPT, ids=ids[0].tolist(), new_tokens=GREEDY,
                       task="text2text-generation", logits_out=tmp_path / "logits.f32")
    assert got["prompt_ids"] == ids[0].tolist()  # </s> appended, as transformers does
    assert got["generate_ids"] == want[0].tolist()
    assert got["pipeline_text"] == tokenizer.decode(want[0], skip_special_tokens=True)
    assert got["logits"]["dtype"] == "float32" and got["logits"]["finite"]
    logits = np.fromfile(tmp_path / "logits.f32", np.float32).reshape(got["logits"]["dims"])
    kl = mean_kl(ref, torch.from_numpy(logits).double())
    assert kl < 5e-6, kl  # measured 8.8e-7 (tiny T5 v1.1), 9.7e-13 (tiny BART), both versions
