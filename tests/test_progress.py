"""Progress a user can read (halfsafe.progress): blocks done / total with a numeric ETA from the first block on, the
bar and the ETA weighing each unit by its parameters (a wide LM head is most of a small model's work), plain lines
when the output is not a terminal, silence in the Python API unless asked, and every phase's wall and CPU seconds in
convert's and verify's --json reports (never in halfsafe.json).

No test here reads the real clock: `progress.clock` is one the test moves, and the timer thread's interval is longer
than any test runs, so what is printed is what that clock decides (a phase that lasted the interval prints its
`done` line)."""

from __future__ import annotations

import importlib
import io
import json
import math
import re
from contextlib import contextmanager

import pytest

import halfsafe.core.forward as forward
import halfsafe.engine.wide as wide
from halfsafe import progress
from halfsafe.cli import main
from halfsafe.core.forward import logits, run_for_stats
from halfsafe.core.sites import find_blocks
from halfsafe.engine.precision import in_dtype
from halfsafe.engine.streamed import streamed_of
from halfsafe.io.loading import load_model, model_class_for
from tests.tiny import TINY, save_tiny, tiny_ids

scan = importlib.import_module("halfsafe.scan")
LINE = re.compile(r"^scan: (\d+)/(\d+) blocks(?:, (\d+)%)?, sample (\d+)/3, \d+ s(?:, ETA (\d+) s)?$")
INTERVAL = 1000.0  # the timer thread's, in real seconds: it never prints during a test


class Clock:
    """progress.clock, moved by the test: `now` seconds, plus `step` more at every reading."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress, "clock", c)
    monkeypatch.setattr(progress, "INTERVAL", INTERVAL)
    return c


@pytest.fixture
def shown(clock):
    """Plain lines into a buffer."""
    out = io.StringIO()
    progress.show(out)
    yield out
    progress.hide()


def _ticking_blocks(model, clock: Clock, seconds: float):
    """Each block takes `seconds` by the clock (hooks that run before the phase's own)."""

    def tick(*a):
        clock.now += seconds

    return [model.get_submodule(b).register_forward_hook(tick) for b in find_blocks(model)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_plain_lines_count_blocks_with_a_numeric_eta_after_the_first(shown, clock, stream, tmp_path):
    save_tiny("llama", tmp_path / "m")
    model = load_model(tmp_path / "m", stream=stream).model
    blocks = find_blocks(model)
    ticks = _ticking_blocks(model, clock, INTERVAL / 2)  # 3 samples x 2 blocks: the phase lasts 3 intervals
    lines = []  # what the timer thread would print, read after every block
    with progress.recording() as phases, progress.phase("scan", model, passes=3) as p:
        looks = [model.get_submodule(b).register_forward_hook(lambda *a: lines.append(p.line())) for b in blocks]
        lines.append(p.line())
        for _ in range(3):
            run_for_stats(model, tiny_ids(model, 8))
    for h in ticks + looks:
        h.remove()
    assert (p.done, p.total) == (3 * len(blocks), 3 * len(blocks))
    seen = [LINE.match(line) for line in lines]
    assert len(seen) == 1 + 3 * len(blocks) and all(seen), lines
    for m in seen:
        done, total, percent, sample, eta = m.groups()
        assert int(total) == 3 * len(blocks) and (eta is not None) == (percent is not None) == (int(done) > 0), m.group(0)
        assert int(sample) == min(int(done) // len(blocks) + 1, 3)
    printed = shown.getvalue()
    assert "\x1b" not in printed and "\r" not in printed, "plain lines, no bar"
    assert printed == f"scan: done, {3 * len(blocks)} blocks, {3 * INTERVAL:.0f} s\n", printed
    assert [ph["name"] for ph in phases] == ["scan"] and phases[0]["wall_s"] == 3 * INTERVAL and phases[0]["cpu_s"] >= 0


def _wide_head_model(folder=None, stream: bool = False):
    """The tiny Llama with a vocabulary of 4096: its head holds most of its weights (Gemma 3 270M's: 62%); saved
    into `folder` and loaded from there when given."""
    config = TINY["llama"]()
    config.vocab_size = 4096
    model = model_class_for(config)(config).eval()
    if folder is None:
        return model
    model.save_pretrained(folder)
    return load_model(folder, stream=stream, device="cpu").model


@pytest.mark.parametrize("how", ["forward", "head in chunks", "shared head"])
def test_the_eta_weighs_each_unit_by_its_parameters(clock, how, tmp_path, monkeypatch):
    """Each block and the head take as many microseconds (by the clock) as they hold parameters: then the ETA is, at
    every point, exactly the time left, and the bar's fraction the time spent. Blocks counted alike would say
    "ETA 0 s" at a pass's last block with the head's work still to come. The head runs inside the model's forward,
    on chunks of positions after the body (run_for_stats), or, streamed, a slice of rows at a time for every sample
    of the scan's pass (engine.shared_head: no forward of the head; the clock stops at the blocks there)."""
    whole = _wide_head_model()
    blocks = find_blocks(whole)
    cost = {b: sum(t.numel() for t in whole.get_submodule(b).parameters()) for b in blocks}
    head_cost = whole.get_output_embeddings().weight.numel()
    assert head_cost > 2 * sum(cost.values()), "the head is most of the work"
    ids = [tiny_ids(whole, 10, seed=s) for s in (1, 2)]
    model = whole
    if how == "shared head":
        monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
        monkeypatch.setattr(wide, "CHUNK_BYTES", 1)
        model = _wide_head_model(tmp_path / "wide", stream=True)
        streamed_of(model).wide_bytes = 0
    if how == "head in chunks":  # the body, then the head on 4, 4 and 2 positions
        monkeypatch.setattr(forward, "HEAD_CHUNK", 4)
        monkeypatch.setattr(forward, "HEAD_CHUNK_BYTES", 1)
    head = model.get_output_embeddings()
    total = len(ids) * (sum(cost.values()) + head_cost) * 1e-6
    ticks = [model.get_submodule(b).register_forward_hook(lambda *a, b=b: setattr(clock, "now", clock.now + cost[b] * 1e-6))
             for b in blocks]
    ticks.append(head.register_forward_hook(
        lambda m, args, out: setattr(clock, "now", clock.now + head_cost * 1e-6 * args[0].shape[1] / 10)))
    seen, opened, looks = [], [], []  # (the clock, the fraction, the ETA) after each unit or chunk the phase counted

    @contextmanager
    def watched(*a, **k):  # the real phase, looked at after each of its own hooks
        with progress.phase(*a, **k) as p:
            opened.append(p)
            looks.extend(m.register_forward_hook(lambda *a: seen.append((clock.now, p.fraction(), p.eta())))
                         for m in [*(model.get_submodule(b) for b in blocks), head])
            yield p

    if how == "shared head":
        monkeypatch.setattr(scan, "phase", watched)
        scan.collect(model, ids, progress=False)
    else:
        with watched("scan", model, passes=len(ids)):
            for x in ids:
                logits(model, x) if how == "forward" else run_for_stats(model, x)
    for h in ticks + looks:
        h.remove()
    p = opened[0]
    assert seen and p.cost == pytest.approx(total * 1e6) and p.cost_done == pytest.approx(p.cost), "all of it, head included"
    for now, fraction, eta in seen:
        assert fraction == pytest.approx(now / total), (now, fraction)
        if how != "shared head":
            assert eta == pytest.approx(total - now), (now, fraction, eta)
    assert seen[len(blocks) - 1][1] < 0.5, "at the first pass's (or step's) last block the head's work is still to come"


def test_the_write_weighs_each_tensor_by_its_bytes(tmp_path, monkeypatch):
    """A streamed model's write: each tensor written moves the bar by its share of the bytes (the embedding and the
    untied head: 44% each), not by one tensor of n."""
    from safetensors import safe_open

    import halfsafe.engine.write as write

    model = _wide_head_model(tmp_path / "wide", stream=True)
    steps, opened = [], []

    @contextmanager
    def watched(*a, **k):
        with progress.phase(*a, **k) as p:
            opened.append(p)
            p.on_change = lambda: steps.append(p.fraction())
            yield p

    monkeypatch.setattr(write, "phase", watched)
    (tmp_path / "out").mkdir()
    write.save_fp16(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        sizes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    nbytes = sorted(2 * math.prod(shape) for shape in sizes.values())  # float16
    (p,) = opened
    assert p.unit == "tensors" and (p.done, p.total) == (len(sizes), len(sizes)) and p.cost == sum(nbytes)
    moves = sorted(b - a for a, b in zip([0.0, *steps], steps))
    assert moves == pytest.approx([n / sum(nbytes) for n in nbytes]) and moves[-1] > 0.4, moves  # the embedding, the head


def test_a_cast_copy_made_inside_the_phase_is_counted(tmp_path):
    save_tiny("qwen3", tmp_path / "m")
    model = load_model(tmp_path / "m").model
    import torch

    with progress.phase("candidate", model) as p, in_dtype(model, torch.float16) as half:  # an in-memory model: a copy
        assert half is not model
        logits(half, tiny_ids(model, 8))
    assert p.done == p.total == len(find_blocks(model))


def test_the_python_api_is_quiet_unless_asked(tmp_path, capsys, monkeypatch):
    from halfsafe.convert import convert_checkpoint

    save_tiny("llama", tmp_path / "m")
    monkeypatch.setattr(progress, "INTERVAL", INTERVAL)
    monkeypatch.setattr(progress, "clock", Clock(step=INTERVAL))  # every phase lasts the interval: shown, it would print
    report = convert_checkpoint(str(tmp_path / "m"), str(tmp_path / "out"), seq_len=16, max_samples=1)
    captured = capsys.readouterr()
    assert "scan:" not in captured.err + captured.out and "blocks" not in captured.err + captured.out
    assert {"load", "scan", "probe", "write"} <= {ph["name"] for ph in report.phases}


def test_cli_prints_a_line_per_slow_phase_and_reports_the_phases(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL", INTERVAL)
    monkeypatch.setattr(progress, "clock", Clock(step=INTERVAL))  # every phase lasts the interval: each prints its end
    save_tiny("llama", tmp_path / "m")
    out, report, checked = tmp_path / "out", tmp_path / "convert.json", tmp_path / "verify.json"
    assert main(["convert", str(tmp_path / "m"), str(out), "--seq-len", "16", "--max-samples", "2", "--json", str(report)]) == 0
    err = capsys.readouterr().err
    for name in ("scan", "probe", "candidate residual 2^0", "check after"):
        assert re.search(rf"^{re.escape(name)}: done, ", err, re.M), f"no line for {name}:\n{err}"
    assert re.search(r"^scan: done, 6 blocks, ", err, re.M), err  # 2 blocks x (2 samples + the fp32 reference)
    assert not re.search(r"^scan: .*sample", err, re.M), err  # the samples run in step: no sample index
    phases = json.loads(report.read_text())["phases"]
    names = [ph["name"] for ph in phases]
    assert "reference" not in names, "the fp32 reference is computed in the scan's pass"
    assert names[:2] == ["load", "scan"] and names[-1] == "write" and "probe" in names, names
    assert all(set(ph) == {"name", "wall_s", "cpu_s"} and ph["wall_s"] >= 0 and ph["cpu_s"] >= 0 for ph in phases)
    assert "phases" not in json.loads((out / "halfsafe.json").read_text()), "halfsafe.json holds no timings"
    assert main(["verify", str(tmp_path / "m"), str(out), "--seq-len", "16", "--max-samples", "1", "--greedy-tokens", "3",
                 "--json", str(checked)]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^fp32 greedy: done, 3 tokens, ", err, re.M) and re.search(r"^halfsafe fp16: done, ", err, re.M), err
    names = [ph["name"] for ph in json.loads(checked.read_text())["phases"]]
    # only fp32 generates token by token; the variants' greedy comes from one forward in step with theirs (verify.forced)
    assert names[:4] == ["load", "fp32", "fp32 greedy", "fp32 greedy check"] and "halfsafe fp16" in names, names
    assert not any(n.endswith(" greedy") for n in names[4:]), names
