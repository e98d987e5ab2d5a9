"""Progress a user can read (halfsafe.progress): blocks done / total with a numeric ETA from the first block on, plain
lines when the output is not a terminal, silence in the Python API unless asked, and every phase's wall and CPU
seconds in convert's and verify's --json reports (never in halfsafe.json)."""

from __future__ import annotations

import io
import json
import re
import time

import pytest

from halfsafe import progress
from halfsafe.cli import main
from halfsafe.core.forward import logits, run_for_stats
from halfsafe.core.sites import find_blocks
from halfsafe.engine.precision import in_dtype
from halfsafe.io.loading import load_model
from tests.tiny import save_tiny, tiny_ids

LINE = re.compile(r"^scan: (\d+)/(\d+) blocks, sample (\d+)/3, \d+ s(?:, ETA (\d+) s)?$")


@pytest.fixture
def shown(monkeypatch):
    """Plain lines into a buffer, one every 20 ms."""
    monkeypatch.setattr(progress, "INTERVAL", 0.02)
    out = io.StringIO()
    progress.show(out)
    yield out
    progress.hide()


def _slow_blocks(model, seconds: float = 0.03):
    return [model.get_submodule(b).register_forward_hook(lambda *a: time.sleep(seconds)) for b in find_blocks(model)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_plain_lines_count_blocks_with_a_numeric_eta_after_the_first(shown, stream, tmp_path):
    save_tiny("llama", tmp_path / "m")
    model = load_model(tmp_path / "m", stream=stream).model
    slow = _slow_blocks(model)
    with progress.recording() as phases, progress.phase("scan", model, passes=3) as p:
        for _ in range(3):
            run_for_stats(model, tiny_ids(model, 8))
    for h in slow:
        h.remove()
    blocks = len(find_blocks(model))
    assert (p.done, p.total) == (3 * blocks, 3 * blocks)
    lines = shown.getvalue().splitlines()
    assert "\x1b" not in shown.getvalue() and "\r" not in shown.getvalue(), "plain lines, no bar"
    assert lines[-1].startswith(f"scan: done, {3 * blocks} blocks, ")
    seen = [LINE.match(line) for line in lines[:-1]]
    assert seen and all(seen), lines
    for m in seen:
        done, total, sample, eta = m.groups()
        assert int(total) == 3 * blocks and (eta is not None) == (int(done) > 0), m.group(0)  # an ETA once a block is done
        assert int(sample) == min(int(done) // blocks + 1, 3)
    assert [ph["name"] for ph in phases] == ["scan"] and phases[0]["wall_s"] >= 3 * blocks * 0.03 and phases[0]["cpu_s"] >= 0


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
    monkeypatch.setattr(progress, "INTERVAL", 0.005)  # a line every 5 ms, were it shown
    report = convert_checkpoint(str(tmp_path / "m"), str(tmp_path / "out"), seq_len=16, max_samples=1)
    captured = capsys.readouterr()
    assert "scan:" not in captured.err + captured.out and "blocks" not in captured.err + captured.out
    assert {"load", "scan", "probe", "write"} <= {ph["name"] for ph in report.phases}


def test_cli_prints_a_line_per_slow_phase_and_reports_the_phases(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL", 0.0005)  # a phase of more than 0.5 ms prints (the tiny ones take ms)
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
    assert re.search(r"^fp32 greedy: \d/3 tokens, \d+ s", err, re.M) and re.search(r"^halfsafe fp16: done, ", err, re.M), err
    names = [ph["name"] for ph in json.loads(checked.read_text())["phases"]]
    # only fp32 generates token by token; the variants' greedy comes from one forward in step with theirs (verify.forced)
    assert names[:4] == ["load", "fp32", "fp32 greedy", "fp32 greedy check"] and "halfsafe fp16" in names, names
    assert not any(n.endswith(" greedy") for n in names[4:]), names
