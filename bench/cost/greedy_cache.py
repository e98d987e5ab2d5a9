"""Greedy generation on the Gemma 3 270M fixture, streamed fp32 as verify runs it (16-token prompt, N tokens, default
32): with the model's KV cache (verify) and without (every token re-runs the sequence). Output: bench/results/greedy_cache.txt
(run: PYTHONPATH=src python bench/cost/greedy_cache.py 32)."""
import sys
import time

import torch

from halfsafe.calibration import heldout_text, make_samples
from halfsafe.io.loading import load_model
from halfsafe.verify import greedy

WRITES = ("greedy_cache.txt",)  # in bench/results/ (python bench/list.py)

loaded = load_model("gemma3-270m", torch.float32, stream=True)
m = loaded.model
ids = make_samples([heldout_text()], loaded.tokenizer, m.config.get_text_config().vocab_size, 512, 1)[0][:, :16]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
for use_cache in (True, False):
    w, c = time.perf_counter(), time.process_time()
    toks = greedy(m, ids, n, cache_bytes=512 * 262144 * 4, use_cache=use_cache)
    print(f"use_cache={use_cache}: {n} tokens, wall {time.perf_counter() - w:.1f} s, cpu {time.process_time() - c:.1f} s, tokens {toks[:8]}...", flush=True)
