"""What an ONNX exporter is: the contract every exporter module (onnx_decoder, onnx_encoder, onnx_seq2seq) fulfils,
so that the one entry point (halfsafe.export.onnx) runs them all the same way and the registry
(halfsafe.export.exporters) can hand out any of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol


class Exporter(Protocol):
    """An exporter of one kind of model (a module whose functions these are).

    The entry point calls them in this order: `check_exportable` (also before `convert --to onnx` spends its time
    converting), `load_fp16`, `programs` (each graph saved as it comes, one in memory at a time), then `finish`
    once every graph is on disk."""

    def check_exportable(self, config: Any) -> None:
        """Refuse, in one line (UnsupportedModelError), a config of this kind the exporter cannot take."""

    def load_fp16(self, folder: Path) -> Any:
        """The checkpoint in `folder` as the all-fp16 model the graphs are exported from (checked first)."""

    def programs(self, model: Any) -> Iterator[tuple[str, Any]]:
        """(file relative to the folder, `onnx_ir` program) of each graph of `model`, one at a time."""

    def finish(self, folder: Path, name: str) -> None:
        """Config, tokenizer config and card for the graphs saved in `folder`; `name`: the folder's name once in
        place (for the card)."""
