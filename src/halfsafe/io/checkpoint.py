"""Write the converted model as an ordinary fp16 Hugging Face checkpoint, atomically.

The folder is built under a temporary name beside OUT and renamed at the end, so an interrupted run
leaves no half-written OUT. Beside the weights: halfsafe.json (the plan and what was checked, io.report) and a
model card section made from it (io.card).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError
from transformers import PreTrainedModel

from halfsafe_serve.verified import file_identity

from ..engine.write import DEFAULT_MAX_SHARD_SIZE, save_fp16
from ..errors import HalfsafeError
from . import card, owned, report
from .paths import DERIVED_EXTRA, INNER_EXTRA, check_name_lengths, refuse_overlap, refuse_shared_inodes
from .report import Record

log = logging.getLogger(__name__)
_CARRY_OVER = ("LICENSE*", "NOTICE*", "USE_POLICY*", "*TERMS*", "*.md")  # legal text of the source travels with it


@contextmanager
def atomic_folder(out: Path, replace: bool = False, inner: bool = False):
    """Yield a temporary folder beside `out`; when the block succeeds it becomes `out`, when it fails it is removed.
    `replace`: the folder at `out` when the block starts may be replaced (it is renamed aside first and deleted only
    once the new one is in place, so a crash at any moment leaves the old or the new folder, never a half-written
    one), and only while it still holds what halfsafe wrote there: once renamed aside, its files are checked against
    its record by content again (`_check_replaceable`: a file written or saved over in it while this run worked), and
    anything else puts it back and fails the run in one line. Nothing else is ever replaced: a folder that appeared
    at `out` meanwhile (another run's) stays, and this run fails in one line. `inner`: `out` lies inside a folder
    halfsafe is writing (onnx/ of a checkpoint), whose own record covers it: replaced as it is. The temporary and the
    old folder carry halfsafe's mark (io.owned) until they are gone, so that a later run can tell them, and only them,
    from a user's folder of the same name."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    seen = _identity(out) if replace else None
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    made = owned.identity(tmp)
    run = owned.mark(tmp, out, owned.TEMPORARY)
    old = None
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint folder is ordinary
        old, old_made = _swap_in(tmp, out, seen, None if inner else _check_replaceable)
        owned.unmark(out, run)  # the mark moved in with the folder: proven ours (io.owned), it goes now
    finally:
        owned.release(run)
        owned.remove(tmp, made)
        if old is not None:
            owned.remove(old, old_made)


def _swap_in(tmp: Path, out: Path, seen: tuple[int, int] | None,
             check: Callable[[Path, Path], None] | None = None) -> tuple[Path | None, list[int] | None]:
    """Rename `tmp` to `out`, moving aside the folder `seen` (only that one) first, and only while `check(folder, out)`
    passes on it once aside (where no path through `out` reaches it any more); returns the folder holding the old one
    (to delete) and its identity, or None."""
    appeared = HalfsafeError(f"{out} appeared while this run was writing it (another halfsafe run?): it was left as it "
                             "is and this run saved nothing; choose another output folder")
    old = made = run = None
    if seen is not None and os.path.lexists(out):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        made = owned.identity(old)
        run = owned.mark(old, out, owned.OLD, next=owned.identity(tmp))
        try:
            out.rename(old / out.name)
            if _identity(old / out.name) != seen:  # not the folder this run may replace: put it back
                try:
                    _rename_noreplace(old / out.name, out)
                    owned.remove(old, made)
                except OSError:
                    owned.unmark(old)  # another run's folder: kept, never a leftover a later run may delete
                    log.warning("another run's output is kept in %s", old)
                raise appeared
            if check is not None:
                try:
                    check(old / out.name, out)
                except (HalfsafeError, OSError) as e:  # written into while this run worked: it goes back, as it is
                    try:
                        _rename_noreplace(old / out.name, out)
                        owned.remove(old, made)
                    except OSError:
                        owned.unmark(old)
                        log.warning("the folder this run would have replaced is kept in %s", old)
                    if isinstance(e, HalfsafeError):
                        raise HalfsafeError(f"{e} (found as this run came to replace {out}, which it left as it was: this "
                                            "run saved nothing)") from None
                    raise
            try:
                _rename_noreplace(tmp, out)
            except FileExistsError:
                owned.unmark(old)  # the user's folder, kept where this says: a later run leaves it there
                log.warning("the folder this run replaces is kept in %s", old)
                raise appeared from None
            except OSError:  # put the old folder back
                (old / out.name).rename(out)
                owned.remove(old, made)
                raise
        finally:
            owned.release(run)
        return old, made
    try:
        _rename_noreplace(tmp, out)
    except FileExistsError:
        raise appeared from None
    return None, None


def _identity(path: Path) -> tuple[int, int] | None:
    """Which folder sits at `path` (device and inode), None when nothing does."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


_RENAME_NOREPLACE, _AT_FDCWD = 1, -100


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, failing with FileExistsError when `dst` exists (a plain rename would silently replace
    an empty folder). Atomic on Linux (renameat2); elsewhere a check just before the rename."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS):  # anything but "this file system cannot": a real failure
            raise OSError(err, os.strerror(err), str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def clean_stale(out: Path) -> list[Path]:
    """Remove what a killed run left beside `out` (`.OUT.tmp-*`, `.OUT.old-*`), saying so; an `.OUT.old-*` still
    holding a folder while `out` is missing is moved back first. Only folders whose mark proves halfsafe made them for
    `out` (io.owned), and whose run has ended, are touched; any other folder of such a name is left as it is, with
    one warning line."""
    removed: list[Path] = []
    out = Path(out)
    try:
        names = sorted(e.name for e in os.scandir(out.parent))
    except OSError:
        return removed
    for kind, prefix in ((owned.TEMPORARY, f".{out.name}.tmp-"), (owned.OLD, f".{out.name}.old-")):
        for name in (n for n in names if n.startswith(prefix)):
            leftover = out.parent / name
            m = owned.owned(leftover, out, kind)
            if m is None:
                log.warning("%s is named like a halfsafe leftover of %s but carries no mark of a halfsafe run of this "
                            "user: halfsafe leaves it as it is", leftover, out.name)
                continue
            if owned.running(m):
                continue  # another run is writing it now
            kept = leftover / out.name
            in_place = m["next"] is not None and owned.identity(out) == m["next"]  # the new folder made it in
            if kind == owned.OLD and os.path.lexists(kept) and not in_place:
                try:  # killed between renaming the old folder aside and the new one in: it goes back
                    _rename_noreplace(kept, out)
                except OSError:  # something else is at OUT now: the previous output stays where it is
                    owned.unmark(leftover)
                    log.warning("the previous %s is kept in %s (%s is another folder now): halfsafe leaves it as it is",
                                out.name, leftover, out)
                    continue
            if owned.remove(leftover, m["folder"]):
                removed.append(leftover)
                log.warning("removed %s, left by a halfsafe run that did not finish", leftover)
    return removed


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


MARK = report.FILE  # every folder halfsafe writes carries it; --overwrite replaces only those (or empty ones)


def check_out_dir(out: str | Path, overwrite: bool, needed_bytes: int = 0, inputs=()) -> Path:
    """Fail now, not after an hour of work: OUT must not be, hold or lie inside any of `inputs` (the model, its
    folder), nor hold a hard link to one of their files, must not exist unless overwrite (and then be a folder
    halfsafe wrote, holding the bytes it wrote, or an empty one: `_check_replaceable`), its folder must
    be creatable and writable, and the disk must hold `needed_bytes` more (the existing OUT too, which stays until the
    new one is done)."""
    out = Path(out)
    refuse_overlap(out, inputs)
    refuse_shared_inodes(out, "output folder", inputs)  # replacing OUT deletes its files' names
    check_name_lengths(out, "output folder", DERIVED_EXTRA, INNER_EXTRA)  # .OUT.tmp-XXXXXXXX beside it, onnx/... inside
    if out.exists() and not overwrite:
        raise HalfsafeError(f"{out} already exists: choose another output folder or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise HalfsafeError(f"{out} exists and is not a folder: choose another output path")
    if out.is_symlink():
        raise HalfsafeError(f"{out} is a symbolic link: halfsafe writes its output as a folder of its own there and "
                            "replaces no link; choose another output folder")
    if out.exists():
        _check_replaceable(out)
    base = _existing_ancestor(out.parent)
    if not base.is_dir():
        raise HalfsafeError(f"cannot create {out}: {base} is not a folder; choose another output path")
    try:  # os.access says yes to root on a read-only mount: try for real
        probe = Path(tempfile.mkdtemp(prefix=".halfsafe-write-test-", dir=base))
        probe.rmdir()
    except OSError as e:
        raise HalfsafeError(f"cannot write to {base} ({e.strerror}): choose a writable output folder") from None
    if needed_bytes:
        free = shutil.disk_usage(base).free
        if free < needed_bytes:
            raise HalfsafeError(
                f"{base} has {free / 1e9:.2f} GB free, the output needs about {needed_bytes / 1e9:.2f} GB: "
                "free some space or choose another output folder"
            )
    return out


def _check_replaceable(folder: Path, out: Path | None = None) -> None:
    """--overwrite replaces an empty folder, or one halfsafe wrote and nobody changed since: its halfsafe.json (a plain
    file) reads as a record whose `files` lists each file with its sha256, and the folder holds those files, each
    with those bytes, and nothing else. A record from before the digests (or the list) is refused: a file saved over
    at the same size (a fine-tune's weights) cannot be told from the one halfsafe wrote. `out`: the name to say
    (`folder` is OUT, or OUT moved aside just before the swap)."""
    out = Path(out if out is not None else folder)
    entries = sorted(os.listdir(folder))
    if not entries:
        return
    def refuse(why: str) -> HalfsafeError:
        return HalfsafeError(f"{out} holds files halfsafe did not write ({why}): --overwrite replaces only a folder "
                             "halfsafe wrote, or an empty one; choose another output folder")

    mark = folder / MARK
    if mark.is_symlink() or not mark.is_file():
        raise refuse(f"it has no {MARK} of its own")
    try:
        record = report.read(mark)
    except (HalfsafeError, ValueError, TypeError, KeyError, AttributeError):
        raise refuse(f"its {MARK} is not a record halfsafe wrote") from None
    if record.files is None or any(not isinstance(v, dict) for v in record.files.values()):
        raise HalfsafeError(f"{out} was written by halfsafe {record.versions.halfsafe or '(unknown)'}, whose {MARK} lists no "
                            "digest of each file: --overwrite cannot tell its files from ones saved over them at the same "
                            "size; if nothing in it is yours, delete it yourself, else choose another output folder")
    dirs = {p for f in record.files for p in Path(f).parents if p != Path(".")}
    for root, subdirs, names in os.walk(folder):
        for name in sorted(subdirs) + sorted(names):
            path = Path(root) / name
            rel = path.relative_to(folder)
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # gone since the folder was listed: nothing of anyone's to lose
                continue
            if stat.S_ISDIR(st.st_mode) and rel in dirs:
                continue
            if rel == Path(MARK) or (rel == Path(owned.MARK) and owned.owned(folder, out, owned.TEMPORARY)):
                continue  # the mark of the temporary folder this was, proven: a run killed just after its rename
            listed = record.files.get(rel.as_posix())
            if not stat.S_ISREG(st.st_mode) or listed is None:
                raise HalfsafeError(f"{out} holds {rel.as_posix()}, which halfsafe did not write: move it out or choose "
                                    "another output folder")
            try:
                same = st.st_size == listed["bytes"] and _sha256(path) == listed["sha256"]
            except OSError as e:
                raise HalfsafeError(f"{out}'s {rel.as_posix()} cannot be read ({e.strerror}): --overwrite replaces only "
                                    "what it can check it wrote; choose another output folder") from None
            if not same:
                raise HalfsafeError(f"{out}'s {rel.as_posix()} changed since halfsafe wrote it: move it out or choose "
                                    "another output folder")
        subdirs[:] = [d for d in subdirs if (Path(root) / d).relative_to(folder) in dirs]


# A file's digest by what it is on disk: device, inode, size, and the times of its last write and of its last change of
# any kind. A file whose five are as they were when it was hashed holds the bytes hashed (writing it moves ctime, which
# no user can set back; utime() moves it too), so the check right before the swap reads again only what changed since
# the check before the long part, and a multi-GB OUT is read once a run.
_hashed: dict[tuple[int, int, int, int, int], str] = {}
_BLOCK = 1 << 24


def _sha256(path: Path) -> str:
    """The sha256 of the plain file at `path` (never through a symbolic link)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        before = file_identity(os.fstat(f.fileno()))
        if before in _hashed:
            return _hashed[before]
        h = hashlib.sha256()
        while block := f.read(_BLOCK):
            h.update(block)
        if file_identity(os.fstat(f.fileno())) == before:  # not written while it was read: its digest stands
            _hashed[before] = h.hexdigest()
        return h.hexdigest()


def shard_size(value: int | str) -> int:
    """--max-shard-size in bytes: "5GB", "500MiB" or a number of bytes, as transformers reads it; anything else is
    refused in one line (the CLI's parser calls this too, so a typo fails before anything loads)."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(int(value) if isinstance(value, str) and value.strip().isdigit() else value)
    except (ValueError, TypeError, AttributeError):
        size = None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise HalfsafeError(f"--max-shard-size {value!r} is not a size: give e.g. 5GB, 500MB or a number of bytes")
    return size


def output_bytes(model: PreTrainedModel) -> int:
    """The float16 checkpoint's size: 2 bytes per distinct parameter, plus room for tokenizer and metadata."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return 2 * sum(seen.values()) + (64 << 20)


def save_fp16_checkpoint(
    model: PreTrainedModel, tokenizer, out: str | Path, record: Record | Callable[[], Record] | None, source_folder: Path | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, progress: bool = False, finish: Callable[[Path], None] | None = None,
) -> Path:
    """Save `model` as float16 (the caller's model is left as it is) with its tokenizer, `record` as halfsafe.json and
    the model card made from it (io.report, io.card; None: halfsafe.json holds only the versions, and no card is
    written). A streamed model is written tensor by tensor from its shards. `finish(folder)`, when given, adds to
    the complete checkpoint in its temporary folder before it becomes `out` (convert --to onnx exports there), so
    `out` appears once, with all of it, or not at all."""
    out = check_out_dir(out, overwrite, output_bytes(model), inputs=[source_folder])
    try:
        with atomic_folder(out, replace=overwrite) as tmp:
            save_fp16(model, tmp, max_shard_size, progress)
            _write_extras(tokenizer, tmp, record() if callable(record) else record, source_folder)  # a callable: made now, after the weights
            if finish is not None:
                finish(tmp)
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise HalfsafeError(f"could not write {out} ({reason}): nothing was left behind. Free some space or choose "
                            "another output folder") from None
    return out


def _write_extras(tokenizer, tmp: Path, record: Record | None, source_folder: Path | None) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if source_folder is not None:
        for pattern in _CARRY_OVER:
            for f in source_folder.glob(pattern):
                if f.is_file() and not (tmp / f.name).exists():
                    shutil.copy2(f, tmp / f.name)
    report.write(tmp, record)
    if record is not None:
        card.write(tmp, record)
    report.seal(tmp)
