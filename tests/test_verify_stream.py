"""`verify` block by block (halfsafe.engine): on folders it streams the original and the converted checkpoint, each
variant loading its units in its own dtype, and reports exactly what the whole-model path reports, holding one
block's weights (and the embeddings/head during a forward) at a time."""

from __future__ import annotations

import json
import math

import pytest
import torch
from stress import make_stress
from tiny import make_tiny

from halfsafe.calibration import default_text, heldout_text, make_samples
from halfsafe.convert import convert_checkpoint
from halfsafe.core.forward import logits
from halfsafe.core.sites import find_blocks
from halfsafe.engine.streamed import streamed_of
from halfsafe.verify import ALL_VARIANTS, FP16, HALFSAFE, verify
from halfsafe.verify import runner as runner_module

KEYS = ["gemma3_text", "t5"]  # sandwich norms with (1+w) gains; encoder-decoder (transformers keeps wo fp32)
TEXTS = [heldout_text()[:300]]
ARGS = dict(texts=TEXTS, text_names=["a"], seq_len=16, max_samples=2, greedy_tokens=3, prompt_tokens=5)
TIMING = {"forward_seconds", "forward_tokens_per_s", "wall_s", "cpu_s"}  # differs run to run; everything else must be equal


@pytest.fixture(scope="module", params=KEYS)
def folders(request, tmp_path_factory):
    """A tiny model pushed past fp16's range (tests/stress.py), saved as bf16 safetensors, and its conversion."""
    key = request.param
    root = tmp_path_factory.mktemp(key)
    model = make_tiny(key)
    calib = make_samples([default_text()], None, model.config.vocab_size, 24, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.to(torch.bfloat16).save_pretrained(root / "src")
    convert_checkpoint(str(root / "src"), str(root / "out"), seq_len=24, max_samples=2, progress=False)
    return key, root / "src", root / "out"


def _residency(monkeypatch):
    """Record, at the end of every unit's forward in every run verify makes, the parameters loaded then and the
    largest that one block plus the units outside the blocks (embeddings, head, norms) may hold, and whether the
    weights kept loaded between forwards (greedy generation, `resident`) fit in one sample's float32 logits."""
    seen, cached = [], []  # (loaded numel, allowed numel); whether the weights kept between forwards fit their budget
    run = runner_module.Runner._run

    def watched(self, model, variant, reference):
        s = streamed_of(model)
        assert s is not None, f"{variant.name} ran on a model loaded whole"
        blocks = find_blocks(model)
        size = {u: sum(p.numel() for p in model.get_submodule(u).parameters()) for u in s.units}
        allowed = sum(size[u] for u in s.stem) + max(size[u] for u in blocks)

        cache_allowed = ARGS["seq_len"] * model.config.get_text_config().vocab_size * 4  # one sample's fp32 logits

        def count(*_):
            seen.append((sum(p.numel() for p in model.parameters() if p.device.type != "meta"), allowed))
            held = {name for u in s._loaded for _, name in s.units[u]}
            cached.append(sum(t.numel() * t.element_size() for n, t in s._cache.items() if n not in held) <= cache_allowed)

        handles = [model.get_submodule(u).register_forward_hook(count) for u in s.units]
        try:
            return run(self, model, variant, reference)
        finally:
            for h in handles:
                h.remove()
            assert all(p.device.type == "meta" for p in model.parameters()), "weights freed after each run"
            assert not s._cache, "greedy generation's resident weights freed after it"

    monkeypatch.setattr(runner_module.Runner, "_run", watched)
    return seen, cached


def _same(a, b, path="") -> None:
    """Equal JSON values, NaN equal to NaN."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k not in TIMING:
                _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), (path, a, b)
    else:
        assert a == b, (path, a, b)


def test_streamed_verify_reports_what_the_whole_model_verify_reports(folders, monkeypatch):
    key, src, out = folders
    whole = verify(str(src), str(out), stream=False, **ARGS).to_dict()
    seen, cached = _residency(monkeypatch)
    streamed = verify(str(src), str(out), stream=True, **ARGS).to_dict()
    assert [v["name"] for v in streamed["variants"]] == list(ALL_VARIANTS)
    # every metric, greedy token, residual peak per block, parameter and activation byte count bit for bit: the same
    # weights, dtypes and kernels run in the same order
    _same(whole["variants"], streamed["variants"])
    apart = ("variants", "checkpoint_reads")  # only a streamed model reads its checkpoint as it runs
    _same({k: v for k, v in whole.items() if k not in apart}, {k: v for k, v in streamed.items() if k not in apart})
    assert "checkpoint_reads" not in whole and streamed["checkpoint_reads"]["total"] > 0
    results = {v["name"]: v["overall"] for v in streamed["variants"]}
    assert results[HALFSAFE]["nonfinite_logits"] == 0 and results[HALFSAFE]["kl_mean"] > 0
    if key != "t5":  # T5 clamps its own fp16 activations
        assert results[FP16]["nonfinite_logits"] > 0, "the stress model overflows fp16"
    assert results[HALFSAFE]["greedy_total"] == ARGS["greedy_tokens"] and streamed["texts"][0]["samples"] == 2
    # at most one block resident (with the embeddings and head) at any unit's end, in every variant and in generate
    assert seen and all(loaded <= allowed for loaded, allowed in seen), max(seen)
    assert all(cached), "greedy generation kept more weights loaded than one sample's logits take"


def test_cli_verify_device_and_whole(folders, tmp_path):
    from halfsafe.cli import main

    key, src, out = folders
    if key != KEYS[0]:
        pytest.skip("one family is enough for the command line")
    text = tmp_path / "t.txt"
    text.write_text(TEXTS[0])
    common = [str(src), str(out), "--text", str(text), "--seq-len", "16", "--max-samples", "1", "--greedy-tokens", "2"]
    assert main(["verify", *common, "--device", "cpu", "--json", str(tmp_path / "s.json")]) == 0
    assert main(["verify", *common, "--whole", "--json", str(tmp_path / "w.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("s.json", "w.json"))
    _same(a["variants"], b["variants"])
    assert main(["verify", *common, "--device", "tpu"]) == 2  # one-line error naming the choices
    if not torch.cuda.is_available():
        assert main(["verify", *common, "--device", "cuda"]) == 2
