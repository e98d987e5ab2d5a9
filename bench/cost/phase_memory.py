"""Where a command's memory peaks: run `halfsafe demo` (or one of its steps) in this process while a thread samples
the resident set every few milliseconds and, at each new high, records where the main thread is (its halfsafe
and transformers frames). Prints the peak per step and the code that was running at the highest samples.

    python bench/cost/phase_memory.py demo            # scan, convert, verify as `halfsafe demo` runs them
    python bench/cost/phase_memory.py verify OUT      # verify gemma3-270m against a converted folder only
    python bench/cost/phase_memory.py convert OUT     # convert gemma3-270m into OUT only

Peak RSS here is the largest sampled value (a very short spike between samples can be missed); the process's
own high-water mark (getrusage) is printed beside it.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
import traceback

WRITES = ()  # prints only: nothing in bench/results/ (python bench/list.py)

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler(threading.Thread):
    def __init__(self, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.every, self.main = every, threading.main_thread().ident
        self.step, self.peaks, self.tops, self.stop = "start", {}, [], False

    def where(self) -> str:
        frame = sys._current_frames().get(self.main)
        frames = [f for f in traceback.extract_stack(frame) if "halfsafe" in f.filename or "transformers" in f.filename]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))

    def run(self) -> None:
        high = 0
        while not self.stop:
            r = rss()
            self.peaks[self.step] = max(self.peaks.get(self.step, 0), r)
            if r > high * 1.01:
                high = r
                self.tops.append((r, self.step, self.where()))
            time.sleep(self.every)


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "demo"
    out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/halfsafe-phase-memory-out"
    s = Sampler()
    s.start()
    start = time.time()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import halfsafe  # noqa: F401

    s.step = "import"
    time.sleep(0.05)
    if what == "demo":
        from halfsafe.cli import console
        from halfsafe.cli import main as cli_main

        console.quiet = True
        steps = iter(["scan", "convert", "verify"])
        rule = console.rule

        def next_step(*a, **k):
            s.step = next(steps)
            return rule(*a, **k)

        console.rule = next_step
        cli_main(["demo", "--out", out])
    elif what == "convert":
        from halfsafe.convert import convert_checkpoint

        s.step = "convert"
        convert_checkpoint("gemma3-270m", out, overwrite=True, progress=False)
    elif what == "verify":
        from halfsafe.verify import verify

        s.step = "verify"
        verify("gemma3-270m", out, seq_len=512, max_samples=2, greedy_tokens=32,
               progress=lambda m: setattr(s, "step", "verify " + m.split(":")[0]))
    s.stop = True
    s.join()
    print(f"{what}: {time.time() - start:.0f} s, getrusage peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    for step, peak in s.peaks.items():
        print(f"  {step:40s} peak {peak / 1e9:.2f} GB")
    print("highest samples:")
    for r, step, where in s.tops[-8:]:
        print(f"  {r / 1e9:.2f} GB  [{step}]  {where}")


if __name__ == "__main__":
    main()
