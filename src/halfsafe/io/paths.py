"""The paths a user names, checked before the slow part: input files that must be regular files (a FIFO would block
the read forever, a device never ends), names the file system can hold (halfsafe's temporary names add characters
to OUT's), and report files (--json, --plot) that are written whole or not at all, never into the model."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path

from ..errors import HalfsafeError
from ..filetypes import input_file, kind  # noqa: F401 (the input checks, with the output checks here)
from ..model_folder import model_root

# `.OUT.tmp-XXXXXXXX` and `.OUT.old-XXXXXXXX` (tempfile's 8 random characters) beside OUT: 14 characters around its name
DERIVED_EXTRA = len(".") + len(".tmp-") + 8
INNER_EXTRA = 64  # the longest path halfsafe writes inside OUT ("onnx/decoder_model_merged_fp16.onnx_data", a shard)


def existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path):
        path = path.parent
    return path


def _limit(base: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(base if base.is_dir() else base.parent, name)
    except (OSError, ValueError):
        return default


def check_name_lengths(path: str | os.PathLike, what: str, extra: int = 0, inner: int = 0) -> None:
    """Every name along `path` fits the file system's NAME_MAX, its last one with `extra` more characters (the
    temporary names derived from it), and the whole path with `inner` more fits PATH_MAX: refused in one line now,
    not as ENAMETOOLONG after the slow part."""
    path = Path(path)
    base = existing_ancestor(path)
    name_max = _limit(base, "PC_NAME_MAX", 255)
    for i, part in enumerate(path.parts):
        size = len(os.fsencode(part)) + (extra if i == len(path.parts) - 1 else 0)
        if part != os.sep and size > name_max:
            more = f" ({extra} characters more in the temporary names halfsafe makes from it)" if extra and i == len(path.parts) - 1 else ""
            raise HalfsafeError(f"{what} {path}: the name {part[:40]}... is {len(os.fsencode(part))} bytes long{more}, longer than "
                                f"this file system allows ({name_max}): choose a shorter name")
    path_max = _limit(base, "PC_PATH_MAX", 4096)
    if len(os.fsencode(str(path))) + extra + inner >= path_max:
        raise HalfsafeError(f"{what} {str(path)[:40]}...: the path is {len(os.fsencode(str(path)))} bytes long, too long for "
                            f"this file system ({path_max} with what halfsafe writes under it): choose a shorter path")


def _inodes(inputs: Iterable) -> set[tuple[int, int]]:
    """Device and inode of every file under `inputs` (files or folders)."""
    seen = set()
    for given in inputs:
        if given is None or not os.path.exists(given):
            continue
        files = [os.path.join(top, f) for top, _, names in os.walk(given) for f in names] if os.path.isdir(given) else [given]
        for f in files:
            try:
                st = os.stat(f)
            except OSError:
                continue
            seen.add((st.st_dev, st.st_ino))
    return seen


def refuse_overlap(out: str | Path, inputs) -> None:
    """halfsafe never writes into, over or around what it reads: `out` (symlinks resolved) may be none of `inputs`,
    hold none of them and lie inside none of them."""
    target = Path(out).expanduser().resolve()
    for given in inputs:
        if given is None:
            continue
        model = Path(given).expanduser().resolve()
        if model.is_dir():
            model = model_root(model)  # a hub cache snapshot: its repository folder, blobs included
        if target == model or model.is_relative_to(target):
            raise HalfsafeError(f"{out} is {'the model' if target == model else 'a folder that holds the model'} {given}: "
                                "halfsafe never writes over or deletes its input; choose an output folder outside it")
        if target.is_relative_to(model):
            raise HalfsafeError(f"{out} is inside the model folder {given}: halfsafe never writes into its input; "
                                "choose an output folder outside it")


def check_report_path(path: str | os.PathLike, what: str, inputs: Iterable = ()) -> Path:
    """A report file (--json, --plot) can be written where it is named, checked before the slow part: not into,
    over or around an input (symlinks resolved, and no hard link to an input's file either), not a folder, its
    names short enough, its folder creatable and writable."""
    inputs = [i for i in inputs if i is not None]
    refuse_overlap(path, inputs)
    path = Path(path)
    check_name_lengths(path, what)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as e:
        raise HalfsafeError(f"{what} {path} cannot be written ({e.strerror}): choose another path") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise HalfsafeError(f"{what} {path} is a folder: name a file (e.g. {path / ('report' + (path.suffix or '.json'))})")
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in _inodes(inputs):
        raise HalfsafeError(f"{what} {path} is a hard link to a file of the model: halfsafe never writes over its input; "
                            "choose another path")
    if st is None or stat.S_ISREG(st.st_mode):
        folder = Path(os.path.realpath(path)).parent
        base = existing_ancestor(folder)
        if not base.is_dir():
            raise HalfsafeError(f"{what} {path}: cannot create its folder, {base} is not a folder; choose another path")
        try:  # os.access says yes to root on a read-only mount: try for real
            fd, probe = tempfile.mkstemp(prefix=".halfsafe-write-test-", dir=base)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise HalfsafeError(f"{what} {path}: cannot write to {base} ({e.strerror}); choose another path") from None
    return path


def write_file(path: str | os.PathLike, write: Callable[[Path], None], what: str = "") -> Path:
    """`write(tmp)` writes the file under a temporary name beside `path` (symlinks followed), which then replaces
    `path` in one rename: a reader sees the old file or the new one, never part of one. An OS error (a full disk, a
    name too long, no permission) leaves nothing behind and is one line. Where `path` is a device or a FIFO
    (/dev/stdout), `write` writes to it directly."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    try:
        if os.path.exists(target) and not target.is_file() and not target.is_dir():
            write(target)
            return path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".halfsafe-", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            write(Path(tmp))
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a report is an ordinary file
            os.replace(tmp, target)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        reason = e.strerror or (errno.errorcode.get(e.errno) if e.errno else None) or str(e)
        raise HalfsafeError(f"could not write {what + ' ' if what else ''}{path} ({reason}): nothing was left behind; free some "
                            "space or choose another path") from None
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

