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
from ..files.filetypes import input_file, kind  # noqa: F401 (the input checks, with the output checks here)
from ..files.model_folder import model_root

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


Read = "tuple[str, str | os.PathLike | None] | str | os.PathLike | None"  # (what it is, path); a bare path: the model


def _reads(inputs: Iterable) -> list[tuple[str, Path]]:
    """Each input as (what it is, its path), None left out; a bare path is the model (a folder or a GGUF file)."""
    out = []
    for given in inputs:
        label, path = given if isinstance(given, tuple) else ("the model", given)
        if path is not None:
            out.append((label, Path(path)))
    return out


def _folder_noun(label: str) -> str:
    return label if label.endswith("folder") else f"{label} folder"


def _inodes(inputs: Iterable) -> dict[tuple[int, int], tuple[str, Path]]:
    """Device and inode of every file under `inputs` (files or folders, symbolic links followed), with the input it
    belongs to."""
    seen = {}
    for label, given in _reads(inputs):
        if not os.path.exists(given):
            continue
        files = [os.path.join(top, f) for top, _, names in os.walk(given) for f in names] if os.path.isdir(given) else [given]
        for f in files:
            try:
                st = os.stat(f)
            except OSError:
                continue
            seen.setdefault((st.st_dev, st.st_ino), (label, given))
    return seen


def refuse_overlap(out: str | Path, inputs: Iterable, what: str = "") -> None:
    """halfsafe never writes into, over or around what it reads: `out` (every symbolic link along it resolved, `..`
    and `.` taken as the file system does) may be none of `inputs` (paths of the model, or (what, path) of any other
    input: a text, a plan, a state, a tokenizer folder), hold none of them and lie inside none of them. `what`: the
    option that names `out`, said first."""
    target = Path(os.path.realpath(Path(out).expanduser()))
    named = f"{what} {out}" if what else str(out)
    for label, given in _reads(inputs):
        read = Path(os.path.realpath(given.expanduser()))
        if read.is_dir():
            read = model_root(read)  # a hub cache snapshot: its repository folder, blobs included
        if target == read or read.is_relative_to(target):
            raise HalfsafeError(f"{named} is {label if target == read else f'a folder that holds {label}'} {given}: halfsafe "
                                "never writes over or deletes its input; choose an output path outside it")
        if target.is_relative_to(read):
            raise HalfsafeError(f"{named} is inside {_folder_noun(label)} {given}: halfsafe never writes into its input; "
                                "choose an output path outside it")


def refuse_shared_inodes(out: str | Path, what: str, inputs: Iterable) -> None:
    """No file at `out`, or under it (a folder halfsafe replaces), is a hard link to a file of `inputs`: writing or
    deleting it would write over, or take a name of, what the command reads."""
    out = Path(out)
    try:
        st = os.stat(out)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        files = [Path(top) / f for top, _, names in os.walk(out) for f in names]
    else:
        files = [out]
    inodes = None
    for f in files:
        try:
            fs = os.stat(f) if f == out else os.lstat(f)
        except OSError:
            continue
        if not stat.S_ISREG(fs.st_mode) or fs.st_nlink < 2:
            continue
        inodes = _inodes(inputs) if inodes is None else inodes
        if (fs.st_dev, fs.st_ino) in inodes:
            label, given = inodes[(fs.st_dev, fs.st_ino)]
            of = "a file of the model" if label == "the model" else f"{label} {given}"
            holds = "" if f == out else f"holds {f.relative_to(out).as_posix()}, "
            raise HalfsafeError(f"{what} {out} {holds}{'which is ' if holds else 'is '}a hard link to {of}: halfsafe never "
                                "writes over its input; choose another path")


def check_report_path(path: str | os.PathLike, what: str, inputs: Iterable = ()) -> Path:
    """A report file (--json, --plot) can be written where it is named, checked before the slow part: not into,
    over or around an input (symlinks resolved, and no hard link to an input's file either), not a folder, its
    names short enough, its folder creatable and writable."""
    inputs = _reads(inputs)
    refuse_overlap(path, inputs, what)
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
    refuse_shared_inodes(path, what, inputs)
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


def check_writes(writes: Iterable[tuple[str, str | os.PathLike, bool]], reads: Iterable) -> None:
    """The one check of every path a command writes against every path it reads, made right after its arguments are
    read, before anything loads (the command line's, for every command). `writes`: (what, path, whether it is an
    output folder: OUT); `reads`: as `refuse_overlap` takes them (the model, its every file, texts, plans, states,
    tokenizer and converted folders). No written path may be, lie inside, hold, lead to (a symbolic link anywhere
    along it, `..`) or be a hard link to what is read; a report is a file `check_report_path` takes; and no two
    written paths may be one file, nor a report lie inside OUT (a file its record does not list)."""
    reads = _reads(reads)
    done: list[tuple[str, Path, bool]] = []
    for what, path, folder in writes:
        if folder:
            refuse_overlap(path, reads)
            refuse_shared_inodes(path, what, reads)
        else:
            check_report_path(path, what, reads)
        where = Path(os.path.realpath(Path(path).expanduser()))
        for other, at, other_folder in done:
            if where == at:
                if folder or other_folder:
                    raise HalfsafeError(f"{what} {path} is the output folder ({other}): name a file for the report")
                raise HalfsafeError(f"{what} {path} and {other} name the same file: give each report its own")
            if (other_folder and where.is_relative_to(at)) or (folder and at.is_relative_to(where)):
                raise HalfsafeError(f"{what} {path} and {other}: a report inside the output folder is a file its "
                                    "halfsafe.json does not list (the next --overwrite would refuse the folder); "
                                    "write the report outside it")
        done.append((f"{what} {path}", where, folder))


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

