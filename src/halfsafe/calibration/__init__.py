"""Calibration text: the embedded default (prose, code, numbers, many languages) or the user's files,
cut into token samples."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import torch

from ..errors import HalfsafeError


def default_text() -> str:
    return files(__package__).joinpath("default.txt").read_text(encoding="utf-8")


def heldout_text() -> str:
    """Text kept out of calibration, for measuring fidelity."""
    return files(__package__).joinpath("heldout.txt").read_text(encoding="utf-8")


def read_texts(paths: list[str | Path] | None) -> list[str]:
    """The user's text files (each must exist and hold text), or the embedded default."""
    if not paths:
        return [default_text()]
    texts = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise HalfsafeError(f"text file {p} does not exist: pass --text with a path to a UTF-8 text file")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise HalfsafeError(f"text file {p} is not UTF-8 text: convert it or pass another --text") from None
        if not text.strip():
            raise HalfsafeError(f"text file {p} is empty: pass --text with a file that holds some text")
        texts.append(text)
    return texts


def encode(text: str, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of `text`; without a tokenizer, its UTF-8 bytes folded into the vocabulary."""
    if tokenizer is None:
        return [b % vocab_size for b in text.encode("utf-8")]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_samples(
    texts: list[str], tokenizer, vocab_size: int, seq_len: int = 512, max_samples: int | None = None
) -> list[torch.Tensor]:
    """Cut each text into [1, seq_len] id tensors (the last piece may be shorter), each led by BOS
    when the tokenizer has one: some models keep their largest activations at the BOS position."""
    if seq_len < 2:
        raise HalfsafeError(f"--seq-len {seq_len} is too short: use at least 2")
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    body = seq_len - (bos is not None)
    samples = []
    for text in texts:
        ids = encode(text, tokenizer, vocab_size)
        for start in range(0, len(ids), body):
            piece = ids[start : start + body]
            if len(piece) < max(2, body // 8) and samples:
                break  # a stub at the end says nothing new
            samples.append(check_ids(torch.tensor([([bos] if bos is not None else []) + piece]), vocab_size, bos))
            if max_samples is not None and len(samples) >= max_samples:
                return samples
    if not samples:
        raise HalfsafeError("the calibration text produced no tokens: pass --text with a longer file")
    return samples


def long_sample_ids(tokenizer, vocab_size: int, n_tokens: int) -> torch.Tensor:
    """One [1, n_tokens] sample for calibrating long contexts, without a long text file: BOS (when the
    tokenizer has one), then the embedded calibration text repeated (never the held-out text)."""
    if n_tokens < 2:
        raise HalfsafeError(f"--long-sample {n_tokens} is too short: use at least 2 tokens")
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    head = [bos] if bos is not None else []
    base = encode(default_text(), tokenizer, vocab_size)
    body = n_tokens - len(head)
    ids = head + (base * (body // len(base) + 1))[:body]
    return check_ids(torch.tensor([ids]), vocab_size, bos)


def check_ids(sample: torch.Tensor, vocab_size: int, bos: int | None = None) -> torch.Tensor:
    """`sample`, refused unless every id (BOS included) names a row of the model's embedding: a tokenizer from another
    model (a larger vocabulary) or a special token outside the vocabulary would fail deep inside the first forward."""
    bad = sample[(sample < 0) | (sample >= vocab_size)]
    if bad.numel():
        token = int(bad[0])
        what = "its BOS token" if token == bos else "a token of the text"
        raise HalfsafeError(f"the tokenizer gives id {token} ({what}), but the model's embedding holds {vocab_size} tokens "
                            f"(ids 0 .. {vocab_size - 1}): the tokenizer is not this model's; give the model's own "
                            "(--tokenizer FOLDER) or fix its vocabulary")
    return sample
