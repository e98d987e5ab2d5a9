"""What a path a user names is, checked before anything opens it: a regular file, or a folder, a device, a FIFO
(a FIFO would block a read forever, a device never ends). Imports nothing of halfsafe's but its error, so every
layer (core's plan reader too) can use it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import HalfsafeError


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def input_file(path: str | os.PathLike, what: str, fix: str) -> Path:
    """`path` (symlinks followed) is a regular file, checked with os.stat before anything opens it; else refused in
    one line that says what it is: missing, a folder, a device, a FIFO."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise HalfsafeError(f"{what} {path} does not exist: {fix}") from None
    except OSError as e:
        raise HalfsafeError(f"{what} {path} cannot be read ({e.strerror}): {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HalfsafeError(f"{what} {path} is {kind(st.st_mode)}, not a file: {fix}")
    return Path(path)
