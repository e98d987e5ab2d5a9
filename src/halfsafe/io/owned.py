"""Which folders beside OUT halfsafe may delete, rename or move back: only those it can prove it made.

A temporary folder (`.OUT.tmp-*`, the new checkpoint being written), an old one (`.OUT.old-*`, the checkpoint
being replaced, moved aside until the new one is in) and a fine-tune's unfinished state (`.OUT.partial`) each
carry a mark file, MARK, written when halfsafe made the folder: what kind of folder it is, the OUT it belongs to, the
run, process and host that made it, the folder's own identity (device and inode, so a mark copied into another
folder proves nothing) and a proof: an HMAC-SHA256 of all that under a key only this user's halfsafe reads
(created once, mode 0600, in halfsafe's cache folder; $HALFSAFE_CACHE moves it). A folder is halfsafe's when its
mark says so and the proof holds; its name alone proves nothing, and anything else is left where it is.

Where the key cannot be made (a read-only cache folder) marks carry no proof, and halfsafe then leaves even its own
leftovers alone, naming them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import stat
import uuid
from pathlib import Path

from .builtin import cache_dir

MARK = ".halfsafe-folder"  # inside a folder halfsafe made beside OUT
KEY_FILE = "folder-key"  # in the cache folder
TEMPORARY, OLD, PARTIAL = "temporary-folder", "old-folder", "partial-folder"
_FIELDS = ("halfsafe", "out", "run", "pid", "started", "host", "folder", "next", "proof")
_MAX_MARK_BYTES = 4096

_keys: dict[str, bytes | None] = {}
_active: set[str] = set()  # runs of this process whose folders are in use


def _key() -> bytes | None:
    """This user's key (made on first use), or None when it can be neither read nor made."""
    folder = cache_dir()
    path = folder / KEY_FILE
    if str(path) in _keys:
        return _keys[str(path)]
    key = _read_key(path)
    if key is None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{KEY_FILE}.{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # never replaces a key another process made meanwhile
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        except OSError:
            pass
        key = _read_key(path)
    _keys[str(path)] = key
    return key


def _read_key(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        text = f.read(200).strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return key if len(key) >= 32 else None


def _proof(key: bytes, fields: dict) -> str:
    body = json.dumps({k: fields[k] for k in _FIELDS if k != "proof"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux), to tell it from a later process with its number."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _identity(path: Path) -> list[int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino] if stat.S_ISDIR(st.st_mode) else None


def mark(folder: Path, out: Path, kind: str, next: list[int] | None = None) -> str:
    """Write the mark of `folder` (just made by this process, for `out`); returns its run id, in use until `release`.
    `next`: of an old folder, the identity of the new folder that is to replace it at `out`."""
    pid = os.getpid()
    fields = {"halfsafe": kind, "out": Path(out).name, "run": uuid.uuid4().hex, "pid": pid, "started": _started(pid),
              "host": socket.gethostname(), "folder": _identity(folder), "next": next}
    key = _key()
    fields["proof"] = _proof(key, fields) if key is not None else None
    _active.add(fields["run"])
    fd = os.open(Path(folder) / MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(fields) + "\n")
    return fields["run"]


def release(run: str) -> None:
    _active.discard(run)


def owned(folder: Path, out: Path, kind: str) -> dict | None:
    """The mark of `folder` when it proves halfsafe made it, as a `kind` folder for `out`; else None. The folder must
    be a real folder (not a symbolic link), and its mark a plain file naming exactly this folder."""
    folder = Path(folder)
    identity = _identity(folder)
    key = _key()
    if identity is None or key is None:
        return None
    try:
        fd = os.open(folder / MARK, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            d = json.loads(f.read(_MAX_MARK_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or sorted(d) != sorted(_FIELDS) or not isinstance(d["proof"], str):
        return None
    if d["halfsafe"] != kind or d["out"] != Path(out).name or d["folder"] != identity:
        return None
    try:
        expected = _proof(key, d)
    except (TypeError, ValueError):
        return None
    return d if hmac.compare_digest(d["proof"], expected) else None


def running(m: dict) -> bool:
    """Whether the run that wrote mark `m` may still be using its folder: this process's own runs in use, a live
    process of the same number started at the same time, or any process on another host (which cannot be checked)."""
    if m["run"] in _active:
        return True
    if m["host"] != socket.gethostname():
        return True
    pid = m["pid"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if pid == os.getpid():
        return False  # this process, not in use: left by a block that could not clean up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    started = _started(pid)
    return started is None or m["started"] is None or started == m["started"]


def unmark(folder: Path, run: str | None = None) -> None:
    """Remove `folder`'s mark (a folder that is now OUT, or one halfsafe keeps for the user to look at)."""
    try:
        (Path(folder) / MARK).unlink()
    except FileNotFoundError:
        pass
    if run is not None:
        release(run)


def remove(folder: Path, identity: list[int] | None) -> bool:
    """Delete `folder` if it is still the folder `identity` names (never a symbolic link, never what it points to)."""
    folder = Path(folder)
    if identity is None or _identity(folder) != identity:
        return False
    shutil.rmtree(folder, ignore_errors=True)  # rmtree refuses a symbolic link and does not follow those inside
    return not os.path.lexists(folder)


def identity(folder: Path) -> list[int] | None:
    """A real folder's device and inode (None for anything else: missing, a file, a symbolic link)."""
    return _identity(Path(folder))
