"""What the input checks cost on the real Gemma 3 270M fixture: the folder's trust check, the config against the
shard headers, and every weight finite, each timed (best of 3) beside the whole streamed load they are part of,
with the resident memory they add (sampled every 2 ms).

    python bench/cost/input_checks.py            # writes bench/results/input_checks.md
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS  # noqa: E402

WRITES = ("input_checks.md",)  # in bench/results/ (python bench/list.py)

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def timed(fn, repeat: int = 3) -> tuple[float, int]:
    """Best wall time of `repeat` runs and the largest resident-memory rise above the start seen during them."""
    best, rise = float("inf"), 0
    for _ in range(repeat):
        start, high, stop = rss(), [0], [False]

        def sample():
            while not stop[0]:
                high[0] = max(high[0], rss())
                time.sleep(0.002)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        stop[0] = True
        t.join()
        rise = max(rise, high[0] - start)
    return best, rise


def main() -> None:
    from halfsafe.engine.shards import Shards
    from halfsafe.io.builtin import gemma3_270m_folder
    from halfsafe.io.loading import load_model, model_class_for, read_config
    from halfsafe.io.trust import check_folder
    from halfsafe.io.validate import check_config, check_finite

    folder = gemma3_270m_folder()
    config, shards = read_config(folder), Shards(folder)
    cls = model_class_for(config)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    rows = [
        ("trust.check_folder (symlinks, auto_map)", timed(lambda: check_folder(folder))),
        ("validate.check_config (headers, meta skeleton)", timed(lambda: check_config(config, cls, shards, folder))),
        ("validate.check_finite (every weight, block by block)", timed(lambda: check_finite(shards, folder))),
        ("load_model(stream=True), all checks included", timed(lambda: load_model(folder, stream=True))),
    ]
    lines = [
        "# Input checks on Gemma 3 270M",
        "",
        f"`python bench/cost/input_checks.py` on {os.cpu_count()} CPUs; the fixture's weights: {size / 1e6:.0f} MB (bf16, "
        f"{len(shards.keys())} tensors). Best of 3 runs; memory: the largest resident-set rise seen during a run.",
        "",
        "| step | time (s) | memory rise (MB) |",
        "|---|---:|---:|",
        *[f"| {name} | {t:.3f} | {rise / 1e6:.0f} |" for name, (t, rise) in rows],
    ]
    text = "\n".join(lines) + "\n"
    out = RESULTS / "input_checks.md"
    out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
