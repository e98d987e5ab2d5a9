"""Calibration text: the embedded default (prose, code, numbers, many languages) or the user's files,
cut into token samples.

A user's file is checked when named (a regular file, UTF-8 text, not empty) and read when cut: only a prefix large
enough for the samples asked (seq_len x max_samples tokens), grown while it gives too few tokens, so a 2 GB file
costs what 32 tokens need. The whole file is read only where every sample is asked for (verify --max-samples 0).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch

from ..errors import HalfsafeError
from ..files.filetypes import input_file


def default_text() -> str:
    return files(__package__).joinpath("default.txt").read_text(encoding="utf-8")


def heldout_text() -> str:
    """Text kept out of calibration, for measuring fidelity."""
    return files(__package__).joinpath("heldout.txt").read_text(encoding="utf-8")


FIRST_READ = 1 << 16  # bytes read when a file is named: enough to say it holds UTF-8 text
BYTES_PER_TOKEN = 16  # the first prefix read for n tokens: n x this (a token is rarely longer), then x4 while short
MARGIN_TOKENS = 256  # tokens cut from a prefix's end beyond those used: a token near the cut may differ from the whole text's


@dataclass(frozen=True)
class TextFile:
    """A user's text file (`read_texts`), read when cut into samples: as much of its start as the samples need."""

    path: Path

    def read(self, limit: int | None = None) -> tuple[str, bool]:
        """The text of the file's first `limit` bytes (None: all of it), cut after its last line break (or space)
        unless the file ends there, with newlines as Python's text mode reads them; and whether that is the whole
        file."""
        try:
            with open(self.path, "rb") as f:
                data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:
            raise HalfsafeError(f"text file {self.path} cannot be read ({e.strerror}): pass another --text") from None
        whole = limit is None or len(data) <= limit
        if not whole:
            data = data[:limit]
            cut = max(data.rfind(b"\n"), data.rfind(b" "))  # never inside a UTF-8 character
            data = data[:cut + 1] if cut >= 0 else data
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
        except UnicodeDecodeError:
            raise HalfsafeError(f"text file {self.path} is not UTF-8 text: convert it or pass another --text") from None
        return text.replace("\r\n", "\n").replace("\r", "\n"), whole

    def blank(self) -> bool:
        """Whether the file holds nothing but white space: read until its first other character, a chunk at a time;
        its first chunk must be UTF-8 text."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(self.path, "rb") as f:
                while chunk := f.read(FIRST_READ):
                    if decoder.decode(chunk).strip():
                        return False
                return not decoder.decode(b"", final=True).strip()
        except UnicodeDecodeError:
            raise HalfsafeError(f"text file {self.path} is not UTF-8 text: convert it or pass another --text") from None
        except OSError as e:
            raise HalfsafeError(f"text file {self.path} cannot be read ({e.strerror}): pass another --text") from None

    def ids(self, tokenizer, vocab_size: int, needed: int | None) -> list[int]:
        """Token ids of the file's start, at least `needed` of them where it holds that many (None: of the whole
        file); the first `needed` are those of the whole text (MARGIN_TOKENS more are read and left at the cut)."""
        size = None if needed is None else BYTES_PER_TOKEN * (needed + MARGIN_TOKENS)
        while True:
            text, whole = self.read(size)
            ids = encode(text, tokenizer, vocab_size)
            if whole:
                return ids
            if len(ids) >= needed + MARGIN_TOKENS:
                return ids[:needed]
            size *= 4


def read_texts(paths: list[str | Path] | None) -> list[str | TextFile]:
    """The user's text files (each a regular file that starts with UTF-8 text), or the embedded default. A file is
    checked here, before anything slow, and read when `make_samples` cuts it (as much as it needs)."""
    if not paths:
        return [default_text()]
    texts = []
    for p in paths:
        text = TextFile(input_file(p, "text file", "pass --text with a path to a UTF-8 text file"))
        if text.blank():
            raise HalfsafeError(f"text file {p} is empty: pass --text with a file that holds some text")
        texts.append(text)
    return texts


def encode(text: str, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of `text`; without a tokenizer, its UTF-8 bytes folded into the vocabulary."""
    if tokenizer is None:
        return [b % vocab_size for b in text.encode("utf-8")]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_samples(
    texts: list[str | TextFile], tokenizer, vocab_size: int, seq_len: int = 512, max_samples: int | None = None
) -> list[torch.Tensor]:
    """Cut each text into [1, seq_len] id tensors (the last piece may be shorter), each led by BOS
    when the tokenizer has one: some models keep their largest activations at the BOS position. A TextFile is read
    as far as the samples still to cut need."""
    if seq_len < 2:
        raise HalfsafeError(f"--seq-len {seq_len} is too short: use at least 2")
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    body = seq_len - (bos is not None)
    samples = []
    for text in texts:
        if isinstance(text, TextFile):
            ids = text.ids(tokenizer, vocab_size, None if max_samples is None else body * (max_samples - len(samples)))
        else:
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


POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")  # gpt2, gpt_neo / bert, opt / bart / pegasus


def position_limit(model: torch.nn.Module) -> int | None:
    """The longest input the model's learned absolute positions cover (its shortest such table, less the rows an
    offset skips: BART's 2, RoBERTa's padding row and those below it), None where it has none (rotary, ALiBi,
    relative): a longer one indexes past it."""
    sizes = [m.num_embeddings - int(getattr(m, "offset", 0)) - (m.padding_idx + 1 if m.padding_idx is not None else 0)
             for name, m in model.named_modules()
             if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES]
    return min(sizes) if sizes else None


def fit_positions(model: torch.nn.Module, seq_len: int, note=None) -> int:
    """`seq_len` where the model's learned positions cover it, else their limit, said through `note(text)`: samples
    as long as the model reads (a default of 512 meets a 128-position tiny model; a GPT-2 reads 1024)."""
    limit = position_limit(model)
    if limit is None or seq_len <= limit:
        return seq_len
    if note is not None:
        note(f"samples of {limit} tokens, not {seq_len} (--seq-len): the model's learned positions end there "
             "(max_position_embeddings)")
    return limit


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
