"""Model size vs peak memory vs time for the block-by-block engine, on synthetic Llama-style checkpoints.

    python bench/cost/engine_scale.py [--sizes 0.3b 0.6b 1.2b] [--capped 1.2b] [--cap-fraction 0.35] [--work DIR]

For each size: write the checkpoint (bench/tools/make_synthetic.py; kept between runs), then run
`halfsafe convert SYN OUT --device cpu` under a hard memory cap (bench/tools/memory_cap.py: a cgroup v1 memory limit):
`cap-fraction` x its float32 size for the `--capped` size, 20 GB (this machine's RAM, less room) for the others;
record exit code, wall time, peak RSS and the cgroup's peak.
Writes bench/results/engine_scale.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import BENCH, RESULTS  # noqa: E402

from make_synthetic import SIZES, config_for  # noqa: E402
from memory_cap import run_capped  # noqa: E402

WRITES = ("engine_scale.json", "engine_scale.md")  # in bench/results/ (python bench/list.py)


def n_params(size: str) -> int:
    c = config_for(size)
    h, L, i, v = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    block = 4 * h * h + 4 * h + 3 * h * i + 2 * i + h + 2 * h  # q,k,v,o (+o bias), gate/up/down (+biases), two norms
    return 2 * v * h + L * block + h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["0.3b", "0.6b", "1.2b"], choices=sorted(SIZES))
    ap.add_argument("--capped", default="1.2b")
    ap.add_argument("--cap-fraction", type=float, default=0.35)
    ap.add_argument("--work", default="/tmp/halfsafe-synthetic")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes:
        src = work / f"llama-{size}"
        if not (src / "config.json").is_file():
            subprocess.run([sys.executable, str(BENCH / "tools" / "make_synthetic.py"), str(src), "--size", size], check=True)
        fp32 = 4 * n_params(size)
        out = work / f"llama-{size}-fp16"
        r = run_capped(int(args.cap_fraction * fp32) if size == args.capped else 20 * 10**9, [str(Path(sys.executable).parent / "halfsafe"), "convert", str(src), str(out),
                                                       "--device", "cpu", "--overwrite"])
        r.update(size=size, params=n_params(size), fp32_gb=fp32 / 1e9, rss_over_fp32=r["peak_rss_gb"] * 1e9 / fp32)
        rows.append(r)
        print(json.dumps(r))
    results = RESULTS
    (results / "engine_scale.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [f"`python bench/cost/engine_scale.py` ({', '.join(args.sizes)}): `halfsafe convert` (8 x 512 calibration tokens, "
             f"streamed, CPU) under a hard cgroup memory cap: {args.cap_fraction:.0%} of the float32 size for llama-{args.capped}, "
             "20 GB for the others.", "",
             "| model | parameters | float32 GB | cap GB | exit | wall s | peak RSS GB | RSS / float32 | cgroup peak GB (incl. page cache) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| llama-{r['size']} | {r['params'] / 1e9:.2f}B | {r['fp32_gb']:.2f} | {r['cap_gb']:.2f} | {r['exit']} | {r['wall_s']:.0f} | "
              f"{r['peak_rss_gb']:.2f} | {r['rss_over_fp32']:.2f} | {r['cgroup_peak_gb']:.2f} |" for r in rows]
    (results / "engine_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
