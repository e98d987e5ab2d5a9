"""What one float16 trial costs (a convert candidate: the model in float16 on 128 tokens, as convert's
evaluate_candidate runs it), with PyTorch's float16 kernels and with the emulation (halfsafe.engine.fp16_arith), on this
CPU as it is and with oneDNN held to AVX512_CORE (ONEDNN_MAX_CPU_ISA, a second process: the float16 matrix kernels
of a CPU without AVX512-FP16). Wall and CPU seconds of the second of two runs, and whether the logits are equal.

    python bench/cost/fp16_trials.py MODEL [MODEL ...]     (MODEL: gemma3-270m or a folder; appends to
                                                      bench/results/fp16_trials.txt)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py: ROOT, RESULTS, the import paths
from common import RESULTS, add_paths  # noqa: E402

WRITES = ("fp16_trials.txt",)  # in bench/results/ (python bench/list.py)

add_paths(".", "src")  # this checkout's halfsafe first
TOKENS = 128


def trial(source: str) -> str:
    from halfsafe.calibration import default_text
    from halfsafe.core.forward import logits
    from halfsafe.engine.precision import in_dtype
    from halfsafe.io.loading import load_model

    loaded = load_model(source, stream=True)
    vocab = loaded.model.config.vocab_size
    ids = (loaded.tokenizer(default_text(), return_tensors="pt").input_ids[:, :TOKENS] if loaded.tokenizer is not None
           else torch.randint(0, vocab, (1, TOKENS), generator=torch.Generator().manual_seed(0))) % vocab
    out, cells = {}, []
    for arith in ("native", "emulated"):
        with in_dtype(loaded.model, torch.float16, arith) as half:
            logits(half, ids)
            wall, cpu = time.perf_counter(), time.process_time()
            out[arith] = logits(half, ids)
            cells.append(f"{arith} {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} CPU-s")
    same = bool(torch.equal(out["native"].nan_to_num(), out["emulated"].nan_to_num()))
    return f"{'; '.join(cells)}; logits equal: {same}"


def main() -> None:
    if sys.argv[1] == "--trial":
        print(trial(sys.argv[2]))
        return
    lines = []
    for source in sys.argv[1:]:
        for isa in (None, "AVX512_CORE"):
            env = {**os.environ, **({"ONEDNN_MAX_CPU_ISA": isa} if isa else {})}
            res = subprocess.run([sys.executable, __file__, "--trial", source], env=env, capture_output=True, text=True, check=True)
            lines.append(f"{source} ({isa or 'this CPU, AVX512-FP16'}; {torch.get_num_threads()} threads, {TOKENS} tokens): "
                         f"{res.stdout.strip().splitlines()[-1]}")
            print(lines[-1], flush=True)
    with open(RESULTS / "fp16_trials.txt", "a") as f:
        f.write(f"# python bench/cost/fp16_trials.py {' '.join(sys.argv[1:])}  (torch {torch.__version__}, "
                f"load average {os.getloadavg()[0]:.1f})\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
