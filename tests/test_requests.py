"""One typed request per command (halfsafe.requests): checked once, in one line, before anything loads; the command
line and the Python API build the same request for the same options; every default is written once."""

from __future__ import annotations

import ast
import math
from os import PathLike
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import halfsafe.io.loading
from halfsafe import cli, convert
from halfsafe import requests as rq
from halfsafe.convert import apply_checkpoint, convert_checkpoint, make_fp16_safe, plan_fp16_safe
from halfsafe.errors import HalfsafeError
from halfsafe.io.checkpoint import shard_size
from halfsafe.runtime.profiles import PROFILES, RuntimeProfile, SplitK
from halfsafe.scan import scan
from halfsafe.training import finetune
from halfsafe.verify import compare

REQUESTS = Path(rq.__file__).parent


class Captured(Exception):
    """Raised by a stand-in for a command's run: the request it was given, and nothing run."""


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(halfsafe.io.loading, "load_model", refuse)


def _one_line_refusal(call, match: str) -> None:
    with pytest.raises(HalfsafeError, match=match) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("options, match", [
    ({"max_context": 0}, r"^--max-context 0 is not a context length: pass a positive number of tokens$"),
    ({"headroom_bits": 16.0}, r"^--headroom-bits 16.0 is out of range: use a number of bits from 0 to 15$"),
    ({"headroom_bits": float("nan")}, r"^--headroom-bits nan is out of range"),
    ({"long_sample": 1}, r"^--long-sample 1 is too short: use at least 2 tokens$"),
    ({"runtime": "webgpu"}, r"^unknown runtime profile 'webgpu': choose one of torch, "),
    ({"fp16_arith": "fast"}, r"^unknown --fp16-arith 'fast': use auto or emulated or native$"),
])
def test_convert_options_are_refused_in_one_line_before_anything(tmp_path, nothing_loads, options, match):
    out = tmp_path / "out"
    _one_line_refusal(lambda: convert_checkpoint(str(tmp_path / "no-such-model"), str(out), **options), match)
    assert not out.exists()
    if set(options) <= {"max_context", "headroom_bits", "runtime", "fp16_arith"}:  # the plan's options: the same checks
        planned = {"headroom_bits": None, "max_context": None, **options}
        _one_line_refusal(lambda: plan_fp16_safe(None, [], **planned), match)
        _one_line_refusal(lambda: make_fp16_safe(None, [], **planned), match)


@pytest.mark.parametrize("options, match", [
    ({"config": rq.FinetuneConfig(steps=0)}, r"^--steps 0 is not a positive number of steps"),
    ({"config": rq.FinetuneConfig(train="head")}, r"^--train 'head': choose one of parent, blocks, all$"),
    ({"config": rq.FinetuneConfig(headroom_bits=20.0)}, r"^--headroom-bits 20.0 is out of range"),
    ({"restart": True, "resume_from": "state.pt"}, r"^--restart discards a saved state and --resume-from continues one"),
])
def test_finetune_options_are_refused_in_one_line_before_anything(tmp_path, nothing_loads, options, match):
    out = tmp_path / "out"
    _one_line_refusal(lambda: finetune.finetune_checkpoint(str(tmp_path / "m"), str(out), **options), match)
    assert not out.exists() and not finetune.partial_dir(out).exists()


@pytest.mark.parametrize("options, match", [
    ({"texts": ["a", "b"], "text_names": ["a"]}, r"^give one name per text$"),
    ({"runtime": "nope"}, r"^unknown runtime profile 'nope'"),
    ({"fp16_arith": "nope"}, r"^unknown --fp16-arith 'nope'"),
])
def test_verify_options_are_refused_in_one_line_before_anything(tmp_path, nothing_loads, options, match):
    _one_line_refusal(lambda: compare.verify(str(tmp_path / "m"), **options), match)


def test_scan_options_are_refused_in_one_line_before_anything():
    _one_line_refusal(lambda: scan(None, [], runtime="nope"), r"^unknown runtime profile 'nope'")
    _one_line_refusal(lambda: scan(None, [], fp16_arith="nope"), r"^unknown --fp16-arith 'nope'")


def _captured(monkeypatch, module, name: str):
    """Replace `module.name` (a command's run) by a stand-in that raises Captured(request)."""
    def capture(request, *args, **kwargs):
        raise Captured(request)

    monkeypatch.setattr(module, name, capture)

    def request_of(call):
        with pytest.raises(Captured) as e:
            call()
        return e.value.args[0]
    return request_of


def _cli(argv: list[str]):
    return cli.build_parser().parse_args(argv)


def test_convert_cli_and_api_build_the_same_request(monkeypatch):
    request_of = _captured(monkeypatch, convert, "run_convert")
    argv = ["convert", "m", "o", "--seq-len", "64", "--max-samples", "3", "--headroom-bits", "2.5", "--max-context", "1000",
            "--long-sample", "128", "--allow-unfixable", "--overwrite", "--whole", "--device", "cpu", "--max-shard-size",
            "1000000", "--runtime", "all-fp16", "--fp16-arith", "native", "--tokenizer", "tok"]
    api = request_of(lambda: convert_checkpoint(
        "m", "o", seq_len=64, max_samples=3, headroom_bits=2.5, max_context=1000, long_sample=128, allow_unfixable=True,
        overwrite=True, stream=False, device="cpu", max_shard_size=1000000, runtime="all-fp16", fp16_arith="native",
        tokenizer="tok"))
    assert cli.convert_request(_cli(argv)) == api
    assert api.plan.runtime is PROFILES["all-fp16"] and api.text == rq.TextOptions(None, 64, 3, "tok")
    # every default, once: the parser's and the API's are the request's
    shard = shard_size(rq.DEFAULT_MAX_SHARD_SIZE)  # the parser reads its default as it reads --max-shard-size
    default = rq.ConvertRequest("m", "o", max_shard_size=shard)
    assert cli.convert_request(_cli(["convert", "m", "o"])) == default
    assert request_of(lambda: convert_checkpoint("m", "o", max_shard_size=shard)) == default
    assert request_of(lambda: convert_checkpoint("m", "o")) == rq.ConvertRequest("m", "o")


def test_convert_to_onnx_chooses_the_checkpoint_under_what_the_graph_leaves():
    """--to onnx: the graph prescales its norms, so the checkpoint is chosen without the profile's norm statistics,
    decided in the request; the graph is exported under the whole profile."""
    for name in PROFILES:
        profile = PROFILES[name]
        asked = rq.ConvertRequest("m", "o", plan=rq.PlanOptions.checked(runtime=name), to="onnx")
        assert asked.export_runtime is profile and asked.checkpoint_runtime == profile.without_norm_stats()
        assert asked.checkpoint_plan.runtime == asked.checkpoint_runtime and asked.checkpoint_plan.margin == asked.plan.margin
        plain = rq.ConvertRequest("m", "o", plan=rq.PlanOptions.checked(runtime=name))
        assert plain.checkpoint_runtime is plain.export_runtime is profile and plain.checkpoint_plan is plain.plan
    assert rq.ConvertRequest("m", "o", plan=rq.PlanOptions.checked(runtime="fp16-norm-stats"), to="onnx").checkpoint_runtime.is_torch
    cli_request = cli.convert_request(_cli(["convert", "m", "o", "--to", "onnx", "--runtime", "all-fp16"]))
    assert cli_request.checkpoint_runtime.name == "all-fp16 (norms in the graph)"


def test_apply_cli_and_api_build_the_same_request(monkeypatch):
    request_of = _captured(monkeypatch, convert, "run_apply")
    argv = ["apply", "plan.json", "m", "o", "--seq-len", "32", "--max-samples", "1", "--overwrite", "--whole", "--device", "cpu"]
    api = request_of(lambda: apply_checkpoint("plan.json", "m", "o", seq_len=32, max_samples=1, overwrite=True, stream=False,
                                              device="cpu"))
    assert cli.apply_request(_cli(argv)) == api
    default = rq.ApplyRequest("plan.json", "m", "o")
    assert default.text == rq.APPLY_TEXT
    assert cli.apply_request(_cli(["apply", "plan.json", "m", "o"])) == default == request_of(lambda: apply_checkpoint("plan.json", "m", "o"))


def test_finetune_cli_and_api_build_the_same_request(monkeypatch):
    request_of = _captured(monkeypatch, finetune, "run_finetune")
    argv = ["finetune", "m", "o", "--steps", "7", "--threshold", "1000", "--margin-bits", "0.5", "--lr", "0.01",
            "--penalty-weight", "2", "--polish-steps", "3", "--train", "blocks", "--headroom-bits", "1.5", "--save-every", "2",
            "--save-unconverged", "--overwrite", "--device", "cpu", "--seq-len", "16", "--max-samples", "4"]
    config = rq.FinetuneConfig(steps=7, threshold=1000.0, margin_bits=0.5, lr=0.01, penalty_weight=2.0, polish_steps=3,
                               train="blocks", headroom_bits=1.5, save_every=2)
    api = request_of(lambda: finetune.finetune_checkpoint("m", "o", seq_len=16, max_samples=4, config=config, overwrite=True,
                                                          save_unconverged=True, device="cpu"))
    assert cli.finetune_request(_cli(argv)) == api
    assert api.plan == rq.PlanOptions(rq.MarginOptions(headroom_bits=1.5), allow_unfixable=True)
    default = rq.FinetuneRequest("m", "o")
    assert cli.finetune_request(_cli(["finetune", "m", "o"])) == default == request_of(lambda: finetune.finetune_checkpoint("m", "o"))


def test_verify_cli_and_api_build_the_same_request(monkeypatch):
    request_of = _captured(monkeypatch, compare, "run_verify")
    argv = ["verify", "m", "c", "--seq-len", "64", "--max-samples", "0", "--greedy-tokens", "4", "--whole", "--device", "cpu",
            "--runtime", "fp16-accumulate", "--fp16-arith", "emulated", "--tokenizer", "tok"]
    api = request_of(lambda: compare.verify("m", "c", seq_len=64, max_samples=None, greedy_tokens=4, stream=False, device="cpu",
                                            runtime="fp16-accumulate", fp16_arith="emulated", tokenizer_folder="tok"))
    assert cli.verify_request(_cli(argv)) == api
    assert api.runtime is PROFILES["fp16-accumulate"] and api.text.max_samples is None  # --max-samples 0: the whole text
    default = rq.VerifyRequest("m")
    assert cli.verify_request(_cli(["verify", "m"])) == default == request_of(lambda: compare.verify("m"))


def test_scan_and_export_cli_requests_hold_profiles():
    scanned = cli.scan_request(_cli(["scan", "m", "--fp16-check", "--runtime", "ort-webgpu", "--fp16-arith", "native"]))
    assert scanned.options == rq.ScanOptions.checked(True, "ort-webgpu", "native")
    assert scanned.options.runtime is PROFILES["ort-webgpu"]
    assert cli.scan_request(_cli(["scan"])) == rq.ScanRequest()  # the built-in model, the scan's text
    exported = cli.export_request(_cli(["export", "onnx", "c", "o", "--runtime", "all-fp16", "--scan"]))
    assert exported == rq.ExportRequest("c", "o", scan=True, runtime=PROFILES["all-fp16"])
    assert cli.export_request(_cli(["export", "onnx", "c", "o"])) == rq.ExportRequest("c", "o")


def test_a_request_holds_a_profile_never_a_name():
    with pytest.raises(HalfsafeError, match="RuntimeProfile"):
        rq.Fp16Options(runtime="all-fp16")
    assert rq.Fp16Options.checked("all-fp16").runtime is PROFILES["all-fp16"]
    assert rq.Fp16Options.checked(None).runtime is PROFILES["torch"] is rq.Fp16Options().runtime
    assert isinstance(rq.ExportRequest("c", "o").runtime, RuntimeProfile)


def test_requests_import_no_torch():
    """The parser reads its defaults from the requests: they (and the profiles they hold) import nothing heavy."""
    allowed = {"__future__", "dataclasses", "math", "numbers", "os", "typing", "errors", "runtime.profiles", "engine.choices"}
    files = [*REQUESTS.glob("*.py"), REQUESTS.parent / "runtime" / "profiles.py", REQUESTS.parent / "engine" / "choices.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = node.module or ""
                assert node.level == 1 and path.parent == REQUESTS or name in allowed or \
                    (node.level == 2 and name in allowed), (path.name, name)
            elif isinstance(node, ast.Import):
                assert all(a.name in allowed for a in node.names), (path.name, [a.name for a in node.names])


# --- every field of every request, built directly in Python: a value of the wrong type or range is refused in one
# line (HalfsafeError, never a TypeError, ValueError or AttributeError from inside), a right one is accepted --------

def _count(least, optional=False):
    return lambda v: (optional and v is None) or (type(v) is int and v >= least)


def _number(ok, optional=False):
    return lambda v: (optional and v is None) or (type(v) in (int, float) and ok(v))


def _choice(choices, optional=False):
    return lambda v: (optional and v is None) or (isinstance(v, str) and v in choices)


def _path(optional=False):
    return lambda v: (optional and v is None) or isinstance(v, (str, PathLike))


def _names(v):
    return v is None or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))


def _flag(v):
    return type(v) is bool


def _of(kind):
    return lambda v: isinstance(v, kind)


def _split_k(v):
    return v is None or isinstance(v, SplitK)


def _device(v):
    return isinstance(v, (str, torch.device))


BITS = _number(lambda v: 0 <= v < 16)
TORCH_PROFILE = PROFILES["torch"]
# request type -> (how one is built with `field` set to `value`, {field: (accepted?, right values worth trying)})
REQUEST_FIELDS = {
    "TextOptions": (lambda **f: rq.TextOptions(**f), {
        "texts": (_names, [["a", "b"], ("x",), []]), "seq_len": (_count(2), [2, 512]),
        "max_samples": (_count(0, True), [0, 8, None]), "tokenizer": (_path(True), ["tok", None])}),
    "EngineOptions": (lambda **f: rq.EngineOptions(**f), {"stream": (_flag, []), "device": (_device, ["cpu", "auto", torch.device("cpu")])}),
    "Fp16Options": (lambda **f: rq.Fp16Options(**f), {
        "runtime": (_of(RuntimeProfile), [TORCH_PROFILE]), "fp16_arith": (_choice(rq.FP16_ARITHS, True), list(rq.FP16_ARITHS))}),
    "MarginOptions": (lambda **f: rq.MarginOptions(**f), {
        "max_context": (_count(1, True), [1, 4096]), "headroom_bits": (_number(lambda v: 0 <= v < 16, True), [0, 2.5, 15.99])}),
    "PlanOptions": (lambda **f: rq.PlanOptions(**f), {
        "margin": (_of(rq.MarginOptions), [rq.MarginOptions()]), "allow_unfixable": (_flag, []),
        "candidates": (_count(1), [1, 3]), "fp16": (_of(rq.Fp16Options), [rq.Fp16Options()]),
        "calib_arith": (_choice(rq.CALIB_ARITHS, True), list(rq.CALIB_ARITHS))}),
    "ConvertRequest": (lambda **f: rq.ConvertRequest(**{"source": "m", "out": "o", **({"to": "onnx"} if "split_k" in f else {}), **f}), {
        "source": (_path(), ["m"]), "out": (_path(), ["o"]), "text": (_of(rq.TextOptions), [rq.CONVERT_TEXT]),
        "plan": (_of(rq.PlanOptions), [rq.PlanOptions()]), "long_sample": (_count(2, True), [2, 4096]),
        "overwrite": (_flag, []), "progress": (_flag, []), "engine": (_of(rq.EngineOptions), [rq.EngineOptions()]),
        "max_shard_size": (lambda v: type(v) in (int, str), ["5GB", 1000]),  # its size: io.checkpoint.shard_size
        "to": (_choice(rq.TARGETS, True), list(rq.TARGETS)),
        "split_k": (_split_k, [SplitK(terms=64), SplitK(groups=(4, 4, 1)), None])}),  # tried with --to onnx, the one it is for
    "ApplyRequest": (lambda **f: rq.ApplyRequest(**{"plan_path": "p", "source": "m", "out": "o", **f}), {
        "plan_path": (_path(), ["p"]), "source": (_path(), ["m"]), "out": (_path(), ["o"]),
        "text": (_of(rq.TextOptions), [rq.APPLY_TEXT]), "overwrite": (_flag, []), "progress": (_flag, []),
        "engine": (_of(rq.EngineOptions), [rq.EngineOptions()])}),
    "ExportRequest": (lambda **f: rq.ExportRequest(**{"converted": "c", "out": "o", **({"format": "gguf"} if "llama_cpp" in f else {}), **f}), {
        "converted": (_path(), ["c"]), "out": (_path(), ["o"]), "format": (_choice(rq.FORMATS), list(rq.FORMATS)),
        "overwrite": (_flag, []), "scan": (_flag, []), "runtime": (_of(RuntimeProfile), [TORCH_PROFILE]),
        "llama_cpp": (_path(True), ["llama.cpp", None]),  # tried with format gguf, the one it is for
        "split_k": (_split_k, [SplitK(terms=64), SplitK(), None])}),
    "FinetuneConfig": (lambda **f: rq.FinetuneRequest("m", "o", config=rq.FinetuneConfig(**f)), {
        "steps": (_count(1), [1, 500]), "threshold": (_number(lambda v: 0 < v <= 65504), [65504, 1e-3, 16384.0]),
        "margin_bits": (BITS, [0, 0.25]), "lr": (_number(lambda v: 0 < v < math.inf), [3e-2, 1]),
        "penalty_weight": (_number(lambda v: v > 0), [1.0, math.inf]), "polish_steps": (_count(0), [0, 50]),
        "train": (_choice(rq.TRAIN_MODES), list(rq.TRAIN_MODES)), "save_every": (_count(1), [1, 10]),
        "seed": (lambda v: type(v) is int, [0, -1, 2**40]), "headroom_bits": (BITS, [0, 2.0])}),
    "FinetuneRequest": (lambda **f: rq.FinetuneRequest(**{"source": "m", "out": "o", **f}), {
        "source": (_path(), ["m"]), "out": (_path(), ["o"]), "text": (_of(rq.TextOptions), [rq.FINETUNE_TEXT]),
        "config": (_of(rq.FinetuneConfig), [rq.FinetuneConfig()]), "overwrite": (_flag, []), "restart": (_flag, []),
        "resume_from": (_path(True), ["state.pt", None]), "save_unconverged": (_flag, []), "progress": (_flag, []),
        "device": (_device, ["cpu"])}),
    "ScanOptions": (lambda **f: rq.ScanOptions(**f), {
        "fp16_check": (_flag, []), "fp16": (_of(rq.Fp16Options), [rq.Fp16Options()]),
        "calib_arith": (_choice(rq.CALIB_ARITHS, True), list(rq.CALIB_ARITHS))}),
    "ScanRequest": (lambda **f: rq.ScanRequest(**f), {
        "model": (_path(), ["gemma3-270m"]), "text": (_of(rq.TextOptions), [rq.SCAN_TEXT]),
        "options": (_of(rq.ScanOptions), [rq.ScanOptions()]), "engine": (_of(rq.EngineOptions), [rq.EngineOptions()]),
        "progress": (_flag, [])}),
    "VerifyRequest": (lambda **f: rq.VerifyRequest(**{"model": "m", **f}), {  # model, converted, tokenizer: anything
        "text": (_of(rq.TextOptions), [rq.VERIFY_TEXT]), "text_names": (_names, [["a"], None]),
        "greedy_tokens": (_count(0), [0, 32]), "prompt_tokens": (_count(1), [1, 16]), "variants": (_names, [["fp16"], None]),
        "engine": (_of(rq.EngineOptions), [rq.EngineOptions()]), "fp16": (_of(rq.Fp16Options), [rq.Fp16Options()]),
        "progress": (lambda v: v is None or callable(v), [print, None])}),
}
# values of every kind: most are wrong for any one field, each is either refused in one line or accepted
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10), st.integers(), st.floats(), st.text(max_size=6), st.binary(max_size=3),
    st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=3), st.tuples(st.integers()),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.builds(Path, st.text("ab", min_size=1, max_size=3)),
    st.sampled_from([object(), "onnx\n", "-1", "10", 1.0, 2.5, -1, 0, True, False, math.nan, math.inf, [1], ("a", 1), len,
                     TORCH_PROFILE, "torch", rq.TextOptions(), rq.MarginOptions(), rq.Fp16Options(), rq.EngineOptions(),
                     rq.PlanOptions(), rq.ScanOptions(), rq.FinetuneConfig(), *rq.CALIB_ARITHS, *rq.TRAIN_MODES]))


@pytest.mark.parametrize("kind, name", [(k, n) for k, (_, fields) in REQUEST_FIELDS.items() for n in fields])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_request_built_in_python_refuses_a_wrong_value_of_any_field_in_one_line(kind, name, data):
    build, fields = REQUEST_FIELDS[kind]
    accepted, right = fields[name]
    value = data.draw(st.one_of(ANY_VALUE, *([st.sampled_from(right)] if right else [])), label=name)
    if accepted(value):
        build(**{name: value})  # no error
        return
    with pytest.raises(HalfsafeError) as e:
        build(**{name: value})
    assert "\n" not in str(e.value), str(e.value)


def test_every_field_of_every_request_is_tried():
    """A field added to a request without a line in REQUEST_FIELDS fails here (model, converted and tokenizer of
    verify take models and tokenizers as well as names: anything)."""
    from dataclasses import fields

    for kind, (_, tried) in REQUEST_FIELDS.items():
        cls = getattr(rq, kind)
        untried = {f.name for f in fields(cls)} - set(tried) - ({"model", "converted", "tokenizer"} if kind == "VerifyRequest" else set())
        assert not untried, (kind, untried)
    requests = {n for n in rq.__all__ if isinstance(getattr(rq, n), type) and hasattr(getattr(rq, n), "__dataclass_fields__")}
    assert requests == set(REQUEST_FIELDS)


@pytest.mark.parametrize("value", [0, -1, True, False, 2.5, "10", None, [10]])
def test_save_every_built_directly_is_refused_in_one_line(value):
    with pytest.raises(HalfsafeError, match="^--save-every ") as e:
        rq.FinetuneRequest("m", "o", config=rq.FinetuneConfig(save_every=value))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["tflite", "ONNX", ["onnx"], ("onnx",), True, 1, b"onnx"])
def test_to_built_directly_is_refused_in_one_line(value):
    with pytest.raises(HalfsafeError, match="^--to ") as e:
        rq.ConvertRequest("m", "o", to=value)
    assert "\n" not in str(e.value)
