"""Samples in step through a streamed model (halfsafe.engine.pipeline): every unit is read once per pass over all the
samples, and every number is the one the samples give run one after another (`apart()`), bit for bit: the scan's
statistics in the same order, the fp16 check's first non-finite module, verify's metrics and peaks. Samples whose
paths through the model differ fall back, loudly, to one after another; a failing sample frees everything."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import torch

import halfsafe.core.forward as forward
import halfsafe.engine.wide as wide
from halfsafe.core.forward import logits
from halfsafe.engine.pipeline import apart, in_step
from halfsafe.engine.reads import Reads, checkpoint_bytes
from halfsafe.engine.streamed import streamed_of
from halfsafe.io.loading import load_model
from halfsafe.scan import collect, first_nonfinite_in_fp16
from halfsafe.verify import verify
from tests.tiny import save_tiny, streamable, tiny_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)
STREAMABLE = streamable()  # what the engine streams (tests/tiny.loaded_whole)


def _streamed(key: str, folder):
    save_tiny(key, folder)
    model = load_model(folder, stream=True).model
    assert streamed_of(model) is not None
    return model


def _samples(model, lengths=(12, 12, 12, 20)) -> list[torch.Tensor]:
    return [tiny_ids(model, n, seed=i) for i, n in enumerate(lengths)]


def _stats(sites) -> list:
    """Everything a SiteStats holds, in the sites' order."""
    return [(k, v.module_class, v.abs_max, v.percentile, v.above_fp16_max, v.below_fp16_min_normal, v.nonzero, v.numel,
             v.nonfinite) for k, v in sites.items()]


def _passes(model, run) -> float:
    s = streamed_of(model)
    before = s.shards.bytes_read
    out = run()
    return out, (s.shards.bytes_read - before) / checkpoint_bytes(s)


@pytest.mark.parametrize("key", STREAMABLE)
def test_a_scan_in_step_is_the_per_sample_scan_and_reads_the_checkpoint_once(key, tmp_path):
    model = _streamed(key, tmp_path)
    samples = _samples(model)
    together, reads = _passes(model, lambda: collect(model, samples, progress=False))
    with apart():
        alone, reads_apart = _passes(model, lambda: collect(model, samples, progress=False))
    assert _stats(together) == _stats(alone)
    # each unit the samples run read once for all four (an image-text model's text runs no vision tower: under 1)
    assert reads == 1.0 or key in {"gemma4", "qwen2_vl", "qwen2_5_vl", "t5gemma2"} and reads < 1.0, reads
    assert reads_apart == pytest.approx(4 * reads), "one after another: once per sample"
    assert all(p.device.type == "meta" for p in model.parameters()), "everything freed after the pass"


@pytest.mark.parametrize("key", ["llama", "gemma3", "gpt_oss"])  # decoder, image-text, fused experts (recomputed)
def test_a_forward_beside_the_scan_shares_its_read_and_is_not_recorded(key, tmp_path):
    """convert's float32 reference runs beside the scan's samples: the same statistics as without it, its logits those
    of a forward of its own, bit for bit, and no read of its own."""
    model = _streamed(key, tmp_path)
    samples = _samples(model)
    ids = samples[0][:, :8]
    got = {}
    sites, reads = _passes(model, lambda: collect(model, samples, progress=False,
                                                  beside=[lambda: got.setdefault("logits", logits(model, ids))]))
    assert _stats(sites) == _stats(collect(model, samples, progress=False))
    assert torch.equal(got["logits"], logits(model, ids))
    assert reads == 1.0 or key == "gemma3" and reads < 1.0, reads
    with apart():  # one after another: still unrecorded
        assert _stats(collect(model, samples, progress=False, beside=[lambda: logits(model, ids)])) == _stats(sites)


def test_a_float32_forward_beside_a_bfloat16_calibration_computes_in_float32(tmp_path):
    """convert's reference beside a bfloat16 calibration (engine.calib_arith.float32_products): its logits a float32
    forward's alone, bit for bit, the calibration's statistics as without it, in one read; without the exemption the
    same lane would multiply in bfloat16 (other logits)."""
    from halfsafe.engine.calib_arith import _exempt, calib_arith, float32_products

    model = _streamed("llama", tmp_path)
    samples = _samples(model)
    ids = samples[0][:, :8]
    alone = logits(model, ids)
    got = {}

    def reference():
        with float32_products():
            got["logits"] = logits(model, ids)

    with calib_arith("bfloat16") as mode:
        sites, reads = _passes(model, lambda: collect(model, samples, progress=False, beside=[reference]))
        assert _stats(sites) == _stats(collect(model, samples, progress=False))
        rounded = logits(model, ids)
    assert mode.calls > 0 and not _exempt
    assert torch.equal(got["logits"], alone) and not torch.equal(rounded, alone)
    assert reads == 1.0


@pytest.mark.parametrize("key", ["llama", "gemma3", "t5"])  # decoder, image-text (a vision tower), encoder-decoder
def test_wide_weights_are_read_a_slice_at_a_time_by_each_sample(key, tmp_path, monkeypatch):
    """Every matrix wide: each sample reads a wide weight's slices itself, as alone (samples wait only between blocks,
    holding their hidden states, never inside a product holding its output), and the rest once for all; the samples
    have different lengths (the head runs on a different number of chunks, forward.HEAD_CHUNK)."""
    monkeypatch.setattr(forward, "HEAD_CHUNK_BYTES", 1)  # HEAD_CHUNK positions per head call
    monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
    monkeypatch.setattr(wide, "CHUNK_BYTES", 1)
    model = _streamed(key, tmp_path)
    streamed_of(model).wide_bytes = 0
    samples = _samples(model, (70, 70, 140))  # 2, 2 and 3 head chunks
    together, reads = _passes(model, lambda: collect(model, samples, progress=False))
    with apart():
        alone, reads_apart = _passes(model, lambda: collect(model, samples, progress=False))
    assert _stats(together) == _stats(alone)
    assert 0 < reads_apart - reads < 2, (reads, reads_apart)  # the norms, biases and convolutions once, not three times


def _overflowing(folder):
    """A tiny llama in which a sample holding token 5 overflows float16 at the embedding (its row is 1e5), one holding
    token 6 at the first block's residual add (its row is 65280 and that block's MLP adds about 500), any other never."""
    from tests.tiny import make_tiny

    model = make_tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = 1e5
        model.model.embed_tokens.weight[6] = 65280.0
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0 ** 16)
    model.save_pretrained(folder)
    return load_model(folder, stream=True).model


@pytest.mark.parametrize("order,expected", [((6, 5), "model.layers.0:out"), ((5, 6), "model.embed_tokens:out"),
                                            ((7, 6), "model.layers.0:out"), ((7, 7), None)])
def test_the_fp16_check_in_step_names_the_first_samples_first_overflow(order, expected, tmp_path):
    """The check names the first sample's first non-finite module if it has one, else the second's, as when they run
    one after another, though in step the second sample overflows first."""
    model = _overflowing(tmp_path)
    samples = [torch.tensor([[3, 4, t, 8, 9, 10]]) for t in order]
    together, reads = _passes(model, lambda: first_nonfinite_in_fp16(model, samples))
    with apart():
        alone = first_nonfinite_in_fp16(model, samples)
    assert together == alone == expected
    assert reads == 1.0


def test_samples_taking_different_paths_fall_back_to_one_after_another_loudly(tmp_path, caplog):
    """An image-text model: the first sample gets the synthetic image (the vision tower runs), the second is a dict
    sample of text alone (it does not): different units, so the rest runs one sample at a time, with a warning."""
    model = _streamed("gemma3", tmp_path)
    ids = tiny_ids(model, 12)
    samples = [ids, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids]
    with caplog.at_level(logging.WARNING, logger="halfsafe.engine.pipeline"):
        together, reads = _passes(model, lambda: collect(model, samples, progress=False))
    assert "different paths through the model" in caplog.text
    with apart():
        alone, reads_apart = _passes(model, lambda: collect(model, samples, progress=False))
    assert _stats(together) == _stats(alone)
    assert reads <= reads_apart
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_failing_sample_stops_the_pass_and_frees_every_unit(tmp_path):
    model = _streamed("llama", tmp_path)
    s = streamed_of(model)
    vocab = model.config.vocab_size
    runs = [partial(logits, model, tiny_ids(model, 8)), partial(logits, model, torch.tensor([[1, vocab + 5]]))]
    with pytest.raises(IndexError):
        in_step(model, runs)
    assert s._gate is None and not s._loaded
    assert all(p.device.type == "meta" for p in model.parameters())
    a, b = in_step(model, [partial(logits, model, tiny_ids(model, 8, seed=i)) for i in (1, 2)])  # usable again
    assert torch.equal(a, logits(model, tiny_ids(model, 8, seed=1)))


def test_results_are_handed_on_in_order_one_at_a_time(tmp_path):
    """Each sample's output is handed on as soon as that sample ends, before the next one computes its head: one
    sample's logits alive at a time, as alone."""
    model = _streamed("llama", tmp_path)
    samples = _samples(model, (8, 8, 8))
    events = []

    def run(i):
        out = logits(model, samples[i])
        events.append(f"end {i}")
        return out

    seen = []
    out = in_step(model, [partial(run, i) for i in range(3)], then=lambda i, r: (events.append(f"took {i}"), seen.append(r)))
    with apart():
        ref = [logits(model, ids) for ids in samples]
    assert out == [None] * 3, "handed on, not kept"
    assert events == ["end 0", "took 0", "end 1", "took 1", "end 2", "took 2"]
    assert all(torch.equal(r, ref[i]) for i, r in enumerate(seen))


@pytest.mark.parametrize("key", ["gemma3_text", "t5", "qwen2_vl"])
def test_verify_in_step_reports_what_the_per_sample_runs_report(key, tmp_path):
    save_tiny(key, tmp_path / "m")
    args = dict(texts=["the quick brown fox jumps over the lazy dog " * 8], seq_len=16, max_samples=3, greedy_tokens=2,
                prompt_tokens=4, variants=["bf16", "fp16"])
    together = verify(str(tmp_path / "m"), **args).to_dict()
    with apart():
        alone = verify(str(tmp_path / "m"), **args).to_dict()
    timing = {"forward_seconds", "forward_tokens_per_s"}
    strip = lambda d: [{k: v for k, v in r.items() if k not in timing} for r in d["variants"]]  # noqa: E731
    assert strip(together) == strip(alone)
    reads, reads_apart = together["checkpoint_reads"], alone["checkpoint_reads"]
    for variant in ("fp32", "bf16", "fp16"):  # each unit once, not once per sample (qwen2_vl's text runs no vision tower)
        assert reads[variant] == (1.0 if key != "qwen2_vl" else 0.87), (variant, reads)
        runs = 3 + (variant != "fp32")  # the samples, and a variant's teacher-forced greedy forward (verify.forced)
        assert reads_apart[variant] == pytest.approx(runs * reads[variant], abs=0.005 * runs + 0.01), (variant, reads_apart)  # rounded to 0.01
    assert reads["fp32 greedy"] == reads_apart["fp32 greedy"]


def test_reads_count_passes_per_phase(tmp_path):
    model = _streamed("llama", tmp_path)
    reads = Reads()
    ids = tiny_ids(model, 8)
    with reads.phase(model, "one"):
        logits(model, ids)
    with reads.phase(model, "two"):
        logits(model, ids)
        logits(model, ids)
    with reads.phase(model, "one"):
        logits(model, ids)
    assert reads.to_dict() == {"one": 2.0, "two": 2.0, "total": 4.0}
    assert not Reads(), "nothing counted: empty"


# ----- convert: the reads it makes, and the work it skips


def test_exponents_that_make_the_same_model_share_a_key(tmp_path):
    from halfsafe.core.groups import expand
    from halfsafe.core.rewrite import model_key
    from halfsafe.families import family_for

    model = _streamed("llama", tmp_path)
    groups = expand(family_for("llama"), model)
    names = [g.name for g in groups]
    assert "residual" in names and len(names) > 1
    other = next(n for n in names if n != "residual")
    assert model_key(groups, {"residual": -3}) == model_key(groups, {"residual": -3, other: 0}) == \
        model_key(groups, {other: 0, "residual": -3})
    assert model_key(groups, {"residual": -3}) != model_key(groups, {"residual": -4})
    assert model_key(groups, {"residual": -3}) != model_key(groups, {"residual": -3, other: -1})
    assert model_key(groups, {}) == model_key(groups, {"residual": 0})


def test_convert_reads_the_checkpoint_once_per_pass_and_reports_it(tmp_path, monkeypatch):
    """4 samples scanned in one read, the fp32 reference computed in that same read (and reused for the fp32 check); a
    candidate that makes the same model as one already run (here the solver's plan again, with an explicit zero)
    takes its measurement without another fp16 pass. The same bytes as one sample at a time."""
    import json

    import halfsafe.convert as convert

    usual = convert.candidate_exponents
    extra = []

    def with_a_twin(*args, **kwargs):
        out = usual(*args, **kwargs)
        twin = {**out[0], "o_proj_never": 0}
        extra.append(twin)
        return [out[0], twin, *out[1:]]

    monkeypatch.setattr("halfsafe.convert.candidates.candidate_exponents", with_a_twin)  # where step 5 calls it
    save_tiny("llama", tmp_path / "src")
    args = dict(seq_len=24, max_samples=4, progress=False)
    report = convert.convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"), **args)
    reads = report.to_dict()["checkpoint_reads"]
    kept = [c for c in report.candidates if c.keeps_margin]
    twin = next(c for c in report.candidates if c.exponents == extra[0])
    first = report.candidates[report.candidates.index(twin) - 1]
    assert (twin.kl, twin.top1, twin.finite) == (first.kl, first.top1, first.finite)
    assert reads["scan"] == 1.0 and "reference" not in reads and reads["write"] == 1.0
    assert reads["candidates"] == len(kept) - 1, "the twin ran no pass of its own"
    assert 1.0 <= reads["apply"] < 2.0, "the fp32 check's one forward (and the touched tensors' storage errors)"
    assert reads["total"] == pytest.approx(sum(v for k, v in reads.items() if k != "total"), abs=0.02)
    assert json.loads((tmp_path / "out/halfsafe.json").read_text())["checkpoint_reads"] == reads
    with apart():
        convert.convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "apart"), **args)
    assert (tmp_path / "out/model.safetensors").read_bytes() == (tmp_path / "apart/model.safetensors").read_bytes()
    apart_record = json.loads((tmp_path / "apart/halfsafe.json").read_text())
    assert apart_record["checkpoint_reads"]["scan"] == 5.0, "4 samples and the reference, one read each"
    assert apart_record["candidates"] == json.loads((tmp_path / "out/halfsafe.json").read_text())["candidates"]
