"""Where a model folder ends: every file a checkpoint names must resolve, symlinks followed, to a place inside it.

The path half of the trust boundary (io/trust.py is the whole of it). It imports nothing of halfsafe's but its error
and filetypes (which imports nothing else), so every layer can use it: the engine's shard reader resolves each shard
here, below io/, which drives the engine. `model_file` is where a file of the folder is known to be a regular file
before anything opens it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import HalfsafeError
from .filetypes import kind


def model_root(folder: Path) -> Path:
    """The folder whose inside is trusted: the folder itself, or for a snapshot in the Hugging Face cache
    (models--org--name/snapshots/REV, whose files link into models--org--name/blobs) the repository's folder."""
    folder = Path(folder).resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return folder


def inside(folder: Path, name: str | os.PathLike) -> Path:
    """`folder / name` with every symlink resolved, refused unless it stays inside the folder (see `model_root`).
    The one resolver of every file a checkpoint names."""
    root = model_root(folder)
    path = (Path(folder) / name).resolve()
    if path != root and not path.is_relative_to(root):
        raise HalfsafeError(f"{folder} names {name}, which is {path}, outside the model folder: halfsafe reads only "
                            "files inside MODEL; copy that file into the folder or fix the checkpoint")
    return path


def model_file(folder: Path, name: str | os.PathLike) -> Path | None:
    """`inside(folder, name)` where a regular file is there, None where nothing is; anything else (a FIFO, a device, a
    socket, a folder) is refused without being opened: a FIFO would block its reader forever, a device never ends."""
    path = inside(folder, name)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HalfsafeError(f"{Path(folder) / name} cannot be read ({e.strerror}): fix its permissions or remove it") from None
    if not stat.S_ISREG(mode):
        raise HalfsafeError(f"{Path(folder) / name} is {kind(mode)}, not a file: halfsafe opens only regular files in a "
                            "model folder; replace it with the file itself or remove it")
    return path
