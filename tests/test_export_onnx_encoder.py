"""`halfsafe export onnx` of BERT-style encoders (BERT, RoBERTa) in the transformers.js layout, run by the real client.

Tiny random models saved in bf16 with a BERT-style character tokenizer, converted by halfsafe, exported; then
transformers.js 3.x and 4.x in Node run them through `pipeline('feature-extraction')` (the bare model) and
`pipeline('fill-mask')` (the masked-LM heads), compared with transformers fp32 on the converted checkpoint.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import jsclient  # noqa: E402
import onnx  # noqa: E402
from tiny import TINY, make_tiny  # noqa: E402

from halfsafe.cli import main  # noqa: E402
from halfsafe.convert import convert_checkpoint  # noqa: E402
from halfsafe.errors import UnsupportedModelError  # noqa: E402
from halfsafe.export.onnx import ONNX_FILE, export_onnx  # noqa: E402
from halfsafe.export.onnx_clamps import name_scopes  # noqa: E402
from halfsafe.io.loading import model_class_for  # noqa: E402

# model class -> (tiny config key, the graph's output, the transformers.js task)
MODELS = {
    "BertModel": ("bert", "last_hidden_state", "feature-extraction"),
    "BertForMaskedLM": ("bert", "logits", "fill-mask"),
    "RobertaForMaskedLM": ("roberta", "logits", "fill-mask"),
}
PROMPT = "The quick brown fox jumps over the lazy dog"
MASKED = "The quick [MASK]rown fox"
# max |client - fp32| / max |fp32| over every position and feature (fp16 against fp32), both versions
TOLERANCE = 2e-3  # measured 5.2e-4 (BertModel: the fp16 rounding of its output), 6e-6 (masked-LM logits)
needs_node = pytest.mark.skipif(jsclient.node_missing() is not None, reason=str(jsclient.node_missing()))


def _tiny(name: str):
    key = MODELS[name][0]
    if name == "BertModel":  # the bare encoder, as feature-extraction checkpoints ship
        torch.manual_seed(0)
        config = TINY[key]()
        config.architectures = [name]
        model = model_class_for(config)(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        return model
    return make_tiny(key)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    reports = {}
    for name in MODELS:
        model = _tiny(name)
        model.to(torch.bfloat16).save_pretrained(root / name)
        jsclient.save_bert_char_tokenizer(root / name, model.config)
        convert_checkpoint(str(root / name), str(root / f"{name}-converted"), seq_len=32, max_samples=2, progress=False)
        reports[name] = export_onnx(root / f"{name}-converted", root / f"{name}-onnx")
    return root, reports


def _fp32(root, name: str, text: str):
    from transformers import AutoTokenizer

    from halfsafe.io.loading import read_config

    folder = root / f"{name}-converted"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = model_class_for(read_config(folder)).from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(input_ids=ids)
    return tokenizer, ids, getattr(out, MODELS[name][1]).double()


def _relative_error(got: np.ndarray, want: torch.Tensor) -> float:
    got = torch.from_numpy(got.astype(np.float64)).reshape(want.shape)
    return float((got - want).abs().max() / want.abs().max())


def test_encoder_layout(encoders):
    root, reports = encoders
    for name, (key, output, task) in MODELS.items():
        folder, report = root / f"{name}-onnx", reports[name]
        assert report.path == str(folder / ONNX_FILE) and report.converted and report.clip_nodes == 0
        token_types = ["token_type_ids"] if key == "bert" else []  # RoBERTa has one token type: no input
        assert report.inputs == ["input_ids", "attention_mask", *token_types]
        assert report.outputs == [output]  # BertModel's pooler_output left out
        proto = onnx.load(str(folder / ONNX_FILE))
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(proto.graph.input) + list(proto.graph.output)}
        assert dims["input_ids"] == dims["attention_mask"] == ["batch_size", "sequence_length"]
        assert dims[output][:2] == ["batch_size", "sequence_length"]
        assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # cast from the fp16 graph
        mats = [i for i in proto.graph.initializer if len(i.dims) == 2 and i.data_type != onnx.TensorProto.INT64]
        assert mats and all(i.data_type == onnx.TensorProto.FLOAT16 for i in mats)  # every weight matrix (not position ids)
        assert not any("pooler" in scope for n in proto.graph.node for scope in name_scopes(n))  # its nodes removed too
        config = json.loads((folder / "config.json").read_text())
        assert config["transformers.js_config"] == {"dtype": "fp16"}  # no KV cache
        card = (folder / "README.md").read_text()
        assert f"pipeline('{task}'" in card and f"`{output}` (float32)" in card
        assert not any(folder.glob("*.safetensors"))
    assert "[MASK]" in (root / "BertForMaskedLM-onnx" / "README.md").read_text()


def test_encoder_ort_matches_transformers_fp32(encoders):
    import onnxruntime as ort

    root, reports = encoders
    for name in MODELS:
        _, ids, want = _fp32(root, name, PROMPT)
        session = ort.InferenceSession(reports[name].path, providers=["CPUExecutionProvider"])
        feed = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}
        if "token_type_ids" in reports[name].inputs:
            feed["token_type_ids"] = np.zeros_like(ids.numpy())
        got = session.run(None, feed)[0]
        assert np.isfinite(got).all() and _relative_error(got, want) < TOLERANCE, name


def test_encoder_refusals(tmp_path, capsys):
    model = make_tiny("bert-cls-relu")  # BertForSequenceClassification: no transformers.js layout tested here
    model.save_pretrained(tmp_path / "cls")
    with pytest.raises(UnsupportedModelError, match=r"BertForSequenceClassification\) is not exported.*BertModel"):
        export_onnx(tmp_path / "cls", tmp_path / "cls-onnx")
    assert main(["export", "onnx", str(tmp_path / "cls"), str(tmp_path / "cls-onnx")]) == 2
    err = capsys.readouterr().err
    assert "architectures" in err and "Traceback" not in err and not (tmp_path / "cls-onnx").exists()


@needs_node
@pytest.mark.parametrize("lib", jsclient.VERSIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_js_encoder_matches_transformers_fp32(encoders, name, lib, tmp_path):
    """feature-extraction: the pipeline's token embeddings; fill-mask: the pipeline's top 5 at [MASK]; both: one
    forward's float32 output, finite, within TOLERANCE of transformers fp32."""
    root, _ = encoders
    _, _, task = MODELS[name]
    text = MASKED if task == "fill-mask" else PROMPT
    tokenizer, ids, want = _fp32(root, name, text)
    got = jsclient.run(root / f"{name}-onnx", lib, prompt=text, ids=ids[0].tolist(), task=task,
                       logits_out=tmp_path / "forward.f32", pipeline_out=tmp_path / "pipeline.f32")
    assert got["prompt_ids"] == ids[0].tolist()  # [CLS] ... [SEP], [MASK] one token
    assert got["logits"]["dtype"] == "float32" and got["logits"]["finite"]
    forward = np.fromfile(tmp_path / "forward.f32", np.float32)
    error = _relative_error(forward, want)
    assert error < TOLERANCE, error
    if task == "feature-extraction":
        result = got["pipeline_result"]
        assert result["dtype"] == "float32" and result["finite"] and result["dims"] == list(want.shape)
        assert _relative_error(np.fromfile(tmp_path / "pipeline.f32", np.float32), want) < TOLERANCE
    else:
        at = ids[0].tolist().index(tokenizer.mask_token_id)
        probs = torch.softmax(want[0, at], -1)
        top = torch.topk(probs, 5)
        predictions = got["pipeline_result"]
        assert [p["token"] for p in predictions] == top.indices.tolist()
        assert np.allclose([p["score"] for p in predictions], top.values.numpy(), rtol=TOLERANCE)
