"""One llama.cpp run for tests/test_export_gguf.py, in the llama-cpp-python environment scripts/setup-llama-cpp made
(its own python; halfsafe is not imported here). argv[1]: a JSON job {"gguf", "prompts" (token id lists), "new_tokens"};
prints one JSON line: per prompt, llama.cpp's logits at every prompt position and its greedy continuation, with the
logits each greedy token was picked from."""

from __future__ import annotations

import json
import sys

import numpy as np
from llama_cpp import Llama


def main() -> None:
    job = json.loads(sys.argv[1])
    longest = max(len(p) for p in job["prompts"]) + job["new_tokens"]
    llm = Llama(job["gguf"], n_ctx=max(32, longest), n_batch=longest, logits_all=True, verbose=False, n_threads=1, seed=0)
    out = []
    for ids in job["prompts"]:
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
        greedy, picked = [], []
        for _ in range(job["new_tokens"]):
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            greedy.append(int(last.argmax()))
            picked.append(last.tolist())
            llm.eval([greedy[-1]])
        out.append({"logits": logits.tolist(), "greedy": greedy, "greedy_logits": picked})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
