"""What greedy generation costs on a block-by-block model: 32 tokens from 16 of the held-out text on Gemma 3 270M in
float32, loaded whole, streamed reading every block for every token, and streamed with the blocks kept resident up
to one 512-token sample's float32 logits (what `verify` does). Prints wall and CPU seconds and checks the tokens agree.

    python bench/cost/greedy_stream_cost.py
"""

from __future__ import annotations

import time

import torch

from halfsafe.calibration import heldout_text, make_samples
from halfsafe.io.loading import load_model
from halfsafe.verify.runner import greedy

WRITES = ()  # prints only: nothing in bench/results/ (python bench/list.py)


def timed(label, fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    print(f"{label:48s} wall {time.perf_counter() - w:6.1f} s  cpu {time.process_time() - c:6.1f} s")
    return out


def main() -> None:
    torch.manual_seed(0)
    streamed = load_model("gemma3-270m", stream=True)
    vocab = streamed.model.config.get_text_config().vocab_size
    prompt = make_samples([heldout_text()], streamed.tokenizer, vocab, 512, 1)[0][:, :16]
    budget = 512 * vocab * 4
    a = timed("streamed, every block read per token", lambda: greedy(streamed.model, prompt, 32))
    b = timed(f"streamed, blocks resident up to {budget / 1e9:.2f} GB", lambda: greedy(streamed.model, prompt, 32, budget))
    whole = load_model("gemma3-270m").model
    c = timed("whole model in memory", lambda: greedy(whole, prompt, 32))
    print("tokens agree:", a == b == c)


if __name__ == "__main__":
    main()
