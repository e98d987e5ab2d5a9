"""One llama.cpp run for tests/test_export_gguf.py, in the llama-cpp-python environment scripts/setup-llama-cpp made
(its own python; halfsafe is not imported here), or in the Vulkan build scripts/setup-llama-vulkan made. argv[1]: a JSON
job {"gguf", "prompts" (token id lists), "new_tokens", optionally "n_gpu_layers" (-1: every layer on the GPU backend),
"logits_file" and "seconds"}; prints one JSON line: per prompt, llama.cpp's logits at every prompt position and its
greedy continuation, with the logits each greedy token was picked from. With "logits_file" (a real vocabulary's logits)
those go to that .npz instead, as logits_<i> and greedy_logits_<i> in float32, and the line holds the greedy tokens
alone; with "seconds" the line is {"runs": that list, "seconds": the load's, each prompt's and each decode's wall time}."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    job = json.loads(sys.argv[1])
    start = time.monotonic()
    longest = max(len(p) for p in job["prompts"]) + job["new_tokens"]
    llm = Llama(job["gguf"], n_ctx=max(32, longest), n_batch=longest, logits_all=True, verbose=False, n_threads=1, seed=0,
                n_gpu_layers=job.get("n_gpu_layers", 0))
    out, arrays, seconds = [], {}, {"load": time.monotonic() - start}  # for the bench's notes; no test reads them
    for i, ids in enumerate(job["prompts"]):
        llm.reset()
        start = time.monotonic()
        llm.eval(ids)
        seconds[f"prompt_{i}"] = time.monotonic() - start
        start = time.monotonic()
        logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
        greedy, picked = [], []
        for _ in range(job["new_tokens"]):
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            greedy.append(int(last.argmax()))
            picked.append(last)
            llm.eval([greedy[-1]])
        seconds[f"decode_{i}"] = time.monotonic() - start
        if job.get("logits_file"):
            arrays[f"logits_{i}"] = logits.astype(np.float32)
            arrays[f"greedy_logits_{i}"] = np.array(picked, dtype=np.float32).reshape(len(picked), logits.shape[1])
            out.append({"greedy": greedy})
        else:
            out.append({"logits": logits.tolist(), "greedy": greedy, "greedy_logits": [p.tolist() for p in picked]})
    if arrays:
        np.savez(job["logits_file"], **arrays)
    print(json.dumps(out if not job.get("seconds") else {"runs": out, "seconds": seconds}))


if __name__ == "__main__":
    main()
