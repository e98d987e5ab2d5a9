"""A folder verified once is not hashed again while its files are the same files.

The fingerprint's check (fingerprint.verified_record) reads every byte of the weights: ~1.3 GB/s, ~40 s for a 54 GB
model at each vLLM start, twice where vLLM builds its config twice. `verified(folder)` remembers, per folder (its real
path), the identity of halfsafe.json and of every file the fingerprint covers (device, inode, size, mtime_ns,
ctime_ns) with the digests checked against them: in this process, and in a small file in halfsafe's cache folder that
every process shares. The digests stand in for reading the files only while every one of those identities is
unchanged: a write, a file put in place of another (another inode), or an mtime set back by hand (the ctime moves)
re-hashes the folder. The record is read and checked anew each time, and the digests must still be the ones it
fingerprinted. A cache file that is not this user's alone (another owner, writable by others), or that cannot be read
as this format, is ignored, and so is each malformed entry: the cache can only spare a read, never decide.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path

from .fingerprint import FILE, KEY, covered, verified_record

NAME = "vllm-verified.json"
FORMAT = 1
KEEP = 64  # folders the file remembers, the most recently verified
_MAX_BYTES = 4 << 20
_HEX = re.compile(r"[0-9a-f]{64}")
_memory: dict[str, dict] = {}


def cache_file() -> Path:
    """halfsafe.io.cache.cache_dir()'s rule, without importing halfsafe (torch) into every vLLM process."""
    return Path(os.environ.get("HALFSAFE_CACHE", Path.home() / ".cache" / "halfsafe")).expanduser() / NAME


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What a file is on disk: device, inode, size, and the times of its last write and of its last change of any kind
    (writing moves ctime, which no user can set back): while all five stay, its bytes are the ones last read."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def identities(folder: Path) -> dict[str, list[int]]:
    """{name: file_identity} of halfsafe.json and every covered file."""
    return {name: list(file_identity(os.stat(Path(folder) / name))) for name in (FILE, *covered(folder))}


def verified(folder: str | Path) -> dict:
    """fingerprint.verified_record(folder), reading no file whose digest was checked before under the same identity."""
    folder = Path(folder)
    try:
        real, before = str(folder.resolve()), identities(folder)
    except OSError:  # no halfsafe.json, or a file gone: the check itself says why
        return verified_record(folder)
    entry = _memory.get(real) or _read().get(real)
    if entry is not None and entry["files"] == before:
        return verified_record(folder, entry["sha256"])
    record = verified_record(folder)
    try:
        unchanged = identities(folder) == before
    except OSError:
        unchanged = False
    if unchanged:  # nothing moved while it was hashed: what was checked is what these identities name
        _store(real, {"files": before, "sha256": dict(record[KEY]["sha256"])})
    return record


def _valid(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict) or not isinstance(entry.get("sha256"), dict):
        return False
    files, digests = entry["files"], entry["sha256"]
    return (all(isinstance(v, list) and len(v) == 5 and all(type(x) is int for x in v) for v in files.values())
            and all(isinstance(v, str) and _HEX.fullmatch(v) for v in digests.values()))


def _read() -> dict[str, dict]:
    """The cache file's valid entries; {} for a file that is absent, not this user's alone, or not this format."""
    try:
        fd = os.open(cache_file(), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022 or st.st_size > _MAX_BYTES:
            return {}
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        if fd >= 0:
            os.close(fd)
    folders = data.get("folders") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(folders, dict):
        return {}
    return {k: v for k, v in folders.items() if isinstance(k, str) and _valid(v)}


def _store(real: str, entry: dict) -> None:
    """Remember `entry` here and in the cache file (written whole, then renamed over: no reader sees half of it).
    Two processes storing at once may lose one's entry: it is hashed again next time, nothing worse."""
    _memory[real] = entry
    path = cache_file()
    try:
        folders = {k: v for k, v in _read().items() if k != real}
        folders[real] = entry
        keep = dict(list(folders.items())[-KEEP:])
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{NAME}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "folders": keep}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:  # a read-only or full cache folder: verified, just not remembered across processes
        pass
