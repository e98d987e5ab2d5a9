"""The trust boundary of a model folder, written once.

halfsafe reads a model folder as data: every file the checkpoint names (index entries, shards, tokenizer and
config files) must resolve, symlinks followed, to a place inside the folder, and no Python the folder ships is
ever run. Every transformers load goes through `from_pretrained` here, which passes `trust_remote_code=False`;
a folder whose config files ask for their own code (`auto_map`) is refused before transformers sees it, so
transformers never prompts and never prints. The path rule itself (`inside`, `model_root`) is written in
halfsafe/files/model_folder.py, below the engine, whose shard reader resolves every shard by it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import HalfsafeError
from ..files.model_folder import inside, model_file, model_root  # noqa: F401 (the path half, below the engine that reads shards)

REMOTE_CODE_KEY = "auto_map"  # what transformers reads to import a folder's own classes


def check_folder(folder: Path) -> None:
    """Refuse, before any transformers call and before any file of it is opened, a folder with a file that resolves
    outside it, an entry that is neither a file nor a folder (a FIFO named config.json or model.safetensors would block
    halfsafe's or transformers' read of it forever), or a config file that asks for the folder's own code."""
    folder = Path(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            entry = Path(dirpath) / name
            if entry.is_symlink():
                inside(folder, entry.relative_to(folder))
        for name in filenames:  # os.walk lists every entry that is not a folder here: FIFOs, devices, sockets too
            if os.path.exists(Path(dirpath) / name):  # a dangling link is no file to open
                model_file(folder, (Path(dirpath) / name).relative_to(folder))
    for config in sorted(folder.glob("*config.json")):
        wants = _remote_code(config)
        if wants:
            raise HalfsafeError(f"{config} has {REMOTE_CODE_KEY} ({wants}): this model needs its own Python code, and "
                                "halfsafe never runs code from a model folder; use a model whose architecture transformers ships")


def _remote_code(config: Path) -> str | None:
    """What the file's `auto_map` (at any depth) names, or None."""
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # an unreadable config is the loader's error to report
    todo = [data]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if REMOTE_CODE_KEY in node:
                value = node[REMOTE_CODE_KEY]
                return ", ".join(f"{v}" for v in (value.values() if isinstance(value, dict) else [value]))[:120] or "empty"
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return None


def from_pretrained(cls, path, **kwargs):
    """`cls.from_pretrained(path, **kwargs)` that never runs the folder's code: every transformers load halfsafe
    makes (config, tokenizer, model) comes through here. GenerationConfig reads one JSON file and has no code to
    run (it would store the flag as a generation setting)."""
    from transformers import GenerationConfig

    if not (isinstance(cls, type) and issubclass(cls, GenerationConfig)):
        kwargs["trust_remote_code"] = False
    return cls.from_pretrained(path, **kwargs)


class quiet_transformers:
    """Silence transformers' load-time chatter (progress bars, tie warnings) for the duration."""

    def __enter__(self):
        import transformers

        self._level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        self._bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()

    def __exit__(self, *exc):
        import transformers

        transformers.logging.set_verbosity(self._level)
        if self._bars:
            transformers.utils.logging.enable_progress_bar()
