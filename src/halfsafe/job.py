"""What every command that writes a checkpoint shares: load -> samples -> work -> save, in `run`.

Top level: convert/ (convert, apply) and training/ (finetune) both run it, above io/.

convert, apply and finetune each supply only their own option checks and the work between (`run`'s `check` and
`work`). `run` first checks the output folder (it must not exist unless --overwrite, and must not be or hold the
model), then the command's options, all before anything slow; it loads the model (streamed where asked and possible,
on the device asked: halfsafe.io.loading), refuses an unsupported architecture, checks the disk for the output's size,
cuts the calibration samples and sets the tokenizer aside until the save (Gemma 3's holds 0.33 GB). After the work,
the one save (halfsafe.io.checkpoint) writes the weights, the tokenizer, halfsafe.json and the model card, atomically.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import torch

from .errors import HalfsafeError
from .io.loading import LoadedModel
from .io.report import Record
from .progress import phase
from .requests import DEFAULT_MAX_SHARD_SIZE, EngineOptions, TextOptions

# The io/, families and calibration imports inside run, check_output, start and calibration are read when called: the
# tests replace the slow steps (load_model, check_out_dir, save_fp16_checkpoint, make_samples) in those modules.
T = TypeVar("T")
Extra = Callable[[object, int], torch.Tensor]  # (tokenizer, vocab size) -> one more calibration sample


@dataclass
class Job:
    """What the work gets: the loaded model and the calibration samples cut from the text."""

    loaded: LoadedModel
    samples: list[torch.Tensor]


@dataclass
class Output(Generic[T]):
    """What the work gives back: the command's result, and what is saved with the weights."""

    result: T
    record: Record | Callable[[], Record]  # halfsafe.json and the card; a callable is made once the weights are written
    writing: AbstractContextManager = field(default_factory=nullcontext)  # held around the save (convert counts its reads)


@dataclass(frozen=True)
class Options:
    """What `run` takes of a command's request (halfsafe.requests): built from it by keyword, never from defaults
    of its own."""

    text: TextOptions  # the calibration text, its samples, the tokenizer's folder
    engine: EngineOptions  # streamed or whole, and on which device
    overwrite: bool
    progress: bool
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE  # "5GB", "500MiB" or bytes (io.checkpoint.shard_size)
    reads: tuple = ()  # (what, path) of the other files the command reads (apply's plan, --resume-from): OUT holds none

    def inputs(self) -> list:
        """What OUT may not be, hold or link to besides the model and the tokenizer folder: `reads` and the text files
        (io.paths.refuse_overlap's inputs)."""
        texts = [("the text file", t.path) for t in self.text.texts or () if hasattr(t, "path")]  # calibration.TextFile
        return [*self.reads, *texts]


def run(source, out, options: Options, work: Callable[[Job], Output[T]], check: Callable[[], None] | None = None,
        extra: Extra | None = None, loaded_check: Callable[[LoadedModel], None] | None = None,
        finish: Callable[[Path], None] | None = None) -> T:
    """load -> samples -> work -> save. `check` makes the command's own checks that need more than its request (a
    plan file read, a state folder looked at: after the output, before loading); the request was checked when made;
    `loaded_check(loaded)` what needs the model, right after it loads (before the samples and the work);
    `extra(tokenizer, vocab)`, when given, is one more sample, appended after the text's; `finish(folder)` adds to
    the saved checkpoint in its temporary folder, before it becomes OUT (io.checkpoint.save_fp16_checkpoint)."""
    from .io.checkpoint import save_fp16_checkpoint, shard_size

    text, engine = options.text, options.engine
    reads = options.inputs()
    check_output(source, out, options.overwrite, text.tokenizer, reads)  # the output, then the command's checks, before the slow part
    if check is not None:
        check()
    max_shard_size = shard_size(options.max_shard_size)
    loaded = start(source, out, options.overwrite, engine.stream, engine.device, options.progress, text.tokenizer, reads)
    if loaded_check is not None:
        loaded_check(loaded)
    job, tokenizer = calibration(loaded, text.text_list, text.seq_len, text.max_samples, extra)
    done = work(job)
    with done.writing:
        save_fp16_checkpoint(loaded.model, tokenizer(), out, done.record, loaded.folder, options.overwrite, max_shard_size,
                             options.progress, finish=finish)
    return done.result


def check_output(source, out, overwrite: bool, tokenizer=None, reads=()) -> None:
    """OUT may be written (or replaced, with overwrite) and is not the model (or the --tokenizer folder, or any of
    `reads`: (what, path)) or inside it, nor holds one: before anything slow."""
    from .io.checkpoint import check_out_dir
    from .io.loading import input_paths

    check_out_dir(out, overwrite, inputs=[*input_paths(source), *([tokenizer] if tokenizer else []), *reads])


def start(source, out, overwrite: bool, stream: bool, device, progress: bool, tokenizer=None, reads=()) -> LoadedModel:
    """The model loaded and its family known, the disk checked for the output (`check_output` came first)."""
    from .families import family_for
    from .io.checkpoint import check_out_dir, output_bytes
    from .io.loading import input_paths, load_model

    with phase("load", quiet=not progress):
        loaded = load_model(source, stream=stream, device=device, **({"tokenizer": tokenizer} if tokenizer else {}))
    family_for(loaded.model.config.model_type)  # unsupported architectures fail before the work
    check_out_dir(out, overwrite, output_bytes(loaded.model), inputs=[*input_paths(source), loaded.folder,
                                                                     *([tokenizer] if tokenizer else []), *reads])  # and a small disk
    return loaded


def calibration(loaded: LoadedModel, texts: list[str] | None, seq_len: int, max_samples: int | None,
                extra: Extra | None = None) -> tuple[Job, Callable]:
    """The samples cut from `texts` (default: the embedded text), `extra(tokenizer, vocab)` appended when given, and
    the tokenizer set aside: the job, and the callable that gives the tokenizer back for the save. A model with
    learned positions gets samples no longer than they reach (calibration.fit_positions: shortened, with a note
    on stderr; a longer extra sample, --long-sample, is refused before any forward pass)."""
    from .calibration import fit_positions, make_samples, position_limit, read_texts

    vocab = loaded.model.config.get_text_config().vocab_size
    seq_len = fit_positions(loaded.model, seq_len, lambda text: print(f"note: {text}", file=sys.stderr))
    samples = make_samples(texts or read_texts(None), loaded.tokenizer, vocab, seq_len, max_samples)
    if extra is not None:
        samples.append(extra(loaded.tokenizer, vocab))
        limit = position_limit(loaded.model)
        if limit is not None and samples[-1].shape[-1] > limit:
            raise HalfsafeError(f"--long-sample {samples[-1].shape[-1]} is longer than the model's {limit} learned "
                                f"positions (max_position_embeddings): use --long-sample {limit} or less")
    return Job(loaded, samples), loaded.set_tokenizer_aside()
