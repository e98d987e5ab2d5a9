"""What every command that writes a checkpoint shares: load -> samples -> work -> save.

`check_output` checks the output folder before anything slow (it must not exist unless --overwrite, and must not be or
hold the model); each command calls it first, then checks its own options. `start` loads the model (streamed where asked
and possible, on the device asked: halfsafe.io.loading), refuses an unsupported architecture, and checks the disk for
the output's size. `calibration` cuts the samples and sets the
tokenizer aside until the save (Gemma 3's holds 0.33 GB). convert, apply and finetune supply only the work between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .io.loading import LoadedModel
from .progress import phase


@dataclass
class Job:
    loaded: LoadedModel
    samples: list[torch.Tensor]
    tokenizer: Callable  # gives the tokenizer back, for the save (LoadedModel.set_tokenizer_aside)


def check_output(source, out, overwrite: bool) -> None:
    """OUT may be written (or replaced, with overwrite) and is not the model or inside it: before anything slow."""
    from .io.checkpoint import check_out_dir
    from .io.loading import input_paths

    check_out_dir(out, overwrite, inputs=input_paths(source))


def start(source, out, overwrite: bool, stream: bool, device, progress: bool) -> LoadedModel:
    """The model loaded and its family known, the disk checked for the output (`check_output` came first)."""
    from .families import family_for
    from .io.checkpoint import check_out_dir, output_bytes
    from .io.loading import input_paths, load_model

    with phase("load", quiet=not progress):
        loaded = load_model(source, stream=stream, device=device)
    family_for(loaded.model.config.model_type)  # unsupported architectures fail before the work
    check_out_dir(out, overwrite, output_bytes(loaded.model), inputs=[*input_paths(source), loaded.folder])  # and a small disk
    return loaded


def calibration(loaded: LoadedModel, texts: list[str] | None, seq_len: int, max_samples: int | None,
                extra: Callable[[object, int], torch.Tensor] | None = None) -> Job:
    """The samples cut from `texts` (default: the embedded text), `extra(tokenizer, vocab)` appended when given, and
    the tokenizer set aside."""
    from .calibration import make_samples, read_texts

    vocab = loaded.model.config.get_text_config().vocab_size
    samples = make_samples(texts or read_texts(None), loaded.tokenizer, vocab, seq_len, max_samples)
    if extra is not None:
        samples.append(extra(loaded.tokenizer, vocab))
    return Job(loaded, samples, loaded.set_tokenizer_aside())
