"""bench/cost/scale_7b.py's report: the table, per-phase timings and checkpoint reads when the CLI's reports have them (and
a plain note when not), the 9B / 27B projection computed from the measured convert, and the docs/results.md block it
fills."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scale_7b(bench_script):
    return bench_script("cost", "scale_7b")


def _step(argv: list[str], wall: float, cpu: float, **extra) -> dict:
    return {"argv": argv, "exit": 0, "wall_s": wall, "cpu_s": cpu, "peak_rss_gb": 1.2, "cap_gb": 8.0,
            "cgroup_peak_gb": 7.9, "times_at_cap": 3, **extra}


def _result(scale_7b, **convert_extra) -> dict:
    r = {"command": "python bench/cost/scale_7b.py", "started_utc": "2026-12-01T23:00:00+00:00", "git_commit": "abc",
         "machine": {"cpu": "CPU", "cpu_cores": 2, "memory_gib": 23.4, "torch": "2"}, "load_average": [1.0, 2.0],
         "size": "qwen7b", "architecture": "DeepSeek-R1-Distill-Qwen-7B", "params": 7_615_616_512,
         "checkpoint": "/work/syn7b", "checkpoint_gb": 15.23, "checkpoint_shards": 4, "cap_gb": 8.0,
         "calibration": "default samples x default tokens (the CLI's 8 x 512)", "verify_samples": 1, "verify_seq_len": 512,
         "steps": {"convert": _step(["halfsafe", "convert", "SYN", "OUT"], 761.6, 1523.1, **convert_extra),
                   "verify": _step(["halfsafe", "verify", "SYN", "OUT"], 300, 590)},
         "variants": {"bf16": {"kl_mean": 1.6e-4, "nonfinite_logits": 0, "top1": 0.97, "forward_s": 10.0},
                      "fp16": {"kl_mean": float("nan"), "nonfinite_logits": 99, "top1": 0.0, "forward_s": 30.0},
                      "halfsafe fp16": {"kl_mean": 2.5e-6, "nonfinite_logits": 0, "top1": 0.99, "forward_s": 30.0}}}
    r["projection"] = scale_7b.projection(r)
    return r


def test_projection_scales_the_measured_convert_by_parameters(scale_7b):
    p = _result(scale_7b)["projection"]
    assert p["wall_s_per_billion"] == pytest.approx(100.0, abs=0.05)  # 761.6 s / 7.6156B
    assert p["cpu_s_per_billion"] == pytest.approx(200.0, abs=0.05)
    assert p["models"]["9B"]["convert_wall_min"] == pytest.approx(15.0, abs=0.05)
    assert p["models"]["27B"]["convert_cpu_s"] == pytest.approx(5400, abs=2)
    failed = _result(scale_7b)
    failed["steps"]["convert"]["exit"] = -9
    assert scale_7b.projection(failed) == {}


def test_markdown_with_and_without_phases_and_reads(scale_7b):
    bare = scale_7b.markdown(_result(scale_7b))
    assert "| convert | 0 | 762 | 1523 | 200 | 1.20 | 7.90 | not reported |" in bare
    assert "not in these reports" in bare and "Checkpoint reads" not in bare
    assert "(64x closer to fp32)" in bare and "9B: ~15 min wall" in bare

    full = scale_7b.markdown(_result(scale_7b, phases=[{"name": "scan", "wall_s": 400.0, "cpu_s": 790.5}],
                                     checkpoint_reads={"scan": 1.0, "candidates": 2.0, "total": 3.0}))
    assert "| convert | 0 | 762 | 1523 | 200 | 1.20 | 7.90 | 3 |" in full
    assert "| convert | scan | 400.0 | 790.5 |" in full
    assert "convert: scan 1, candidates 2, total 3" in full


def test_readme_block_is_filled_between_its_markers_only(scale_7b, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{scale_7b.README_BEGIN} (note) -->\nold text\n{scale_7b.README_END}\nafter\n")
    r = _result(scale_7b)
    scale_7b.update_readme(r, readme)
    text = readme.read_text()
    assert text.startswith(f"before\n{scale_7b.README_BEGIN} (note) -->\n`python bench/cost/scale_7b.py`")
    assert text.endswith(f"{scale_7b.README_END}\nafter\n") and "old text" not in text
    scale_7b.update_readme(r, readme)
    assert readme.read_text() == text  # refilling replaces, never stacks

    with pytest.raises(scale_7b.BenchError, match="--size qwen7b"):
        scale_7b.update_readme({**r, "size": "qwen7b-tiny"}, readme)
    readme.write_text("no markers\n")
    with pytest.raises(scale_7b.BenchError, match="markers"):
        scale_7b.update_readme(r, readme)


def test_the_block_lives_in_docs_results_md_as_the_saved_run_writes_it(scale_7b, tmp_path):
    target = inspect.signature(scale_7b.update_readme).parameters["readme"].default
    assert target == ROOT / "docs" / "results.md"
    text = target.read_text()
    assert text.count(scale_7b.README_BEGIN) == 1 and text.count(scale_7b.README_END) == 1
    assert scale_7b.README_BEGIN not in (ROOT / "README.md").read_text()  # the README links to it instead
    copy = tmp_path / "results.md"
    copy.write_text(text)
    scale_7b.update_readme(json.loads((ROOT / "bench" / "results" / "scale_7b.json").read_text()), copy)
    assert copy.read_text() == text, ("docs/results.md's scale_7b block is not what bench/results/scale_7b.json gives: "
                                      "run python bench/cost/scale_7b.py --report-only --readme")


def test_the_cpus_matrix_product_speeds_stand_beside_the_figures(scale_7b):
    g = scale_7b.gemm_speeds((16, 32, 32), budget_s=0.01)
    assert g["shape"] == [16, 32, 32] and g["threads"] >= 1
    assert all(g[d] > 0 for d in ("float32", "bfloat16", "float16"))
    r = _result(scale_7b)
    assert "CPU matrix product speeds: not measured in this run." in scale_7b.markdown(r)  # a .json from before
    r["gemm_gflops"] = {"shape": [256, 1024, 1024], "threads": 2, "float32": 80.0, "bfloat16": 334.0, "float16": 0.9}
    assert ("CPU matrix product speed ([256 x 1024] x [1024 x 1024], 2 threads, best of a few calls): float32 80, "
            "bfloat16 334, float16 0.9 GFLOP/s.") in scale_7b.markdown(r)
