"""One output file written front to back by a thread, while the caller computes the bytes that come next.

`FileOut.write(bytes)` copies into one of two staging blocks; a full block goes to a thread that hashes it (sha256,
for halfsafe.json's fingerprint) and writes it, while the caller fills the other. The copy is the hand-off: the
caller's tensor is free (back to engine.pool) as soon as `write` returns, never read by the thread.

Blocks go straight to the disk (O_DIRECT) where the file system takes it: a checkpoint written through the page cache
costs the kernel a fresh page per 4 KiB (2.2 CPU-s per GB measured on a virtual machine, against 0.15 CPU-s per GB
direct) and pushes the user's cached files out for bytes nobody reads back. Blocks are page-aligned and a whole
number of pages, at offsets that are too; the tail that is not, and every block on a file system that refuses
O_DIRECT (tmpfs, some network and FUSE file systems) or on a system without it, goes through the page cache.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path

BLOCK = 16 << 20  # bytes per staging block: a multiple of any file system's direct-I/O alignment (<= 4096)
ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every block goes through the page cache
_DONE = None


class FileOut:
    """`with FileOut(path) as f: f.write(b); ...; digest = f.close()`: the file holds the bytes in order; `close()`
    returns their sha256 (hex) once every byte is on its way to the disk (written as a plain `write` leaves it). An
    error of the writing thread (a full disk) is raised in the caller, by the next `write` or by `close`."""

    def __init__(self, path: Path, block: int = BLOCK) -> None:
        if block % ALIGN:
            raise ValueError(f"block must be a multiple of {ALIGN}")
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
                           | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.direct = _set_direct(self._fd, True)
        self._blocks = [mmap.mmap(-1, block) for _ in range(2)]  # anonymous maps: page-aligned, as O_DIRECT needs
        self._free: queue.Queue = queue.Queue()
        for i in range(len(self._blocks)):
            self._free.put(i)
        self._full: queue.Queue = queue.Queue()
        self._digest = hashlib.sha256()
        self._error: BaseException | None = None
        self._current, self._filled = self._free.get(), 0
        self.bytes = 0
        self.direct_bytes = 0  # of them, written past the page cache (tests read it)
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name=f"write {self.path.name}", daemon=True)
        self._thread.start()

    # ----- the caller
    def write(self, data) -> None:
        """Copy `data` (any buffer: bytes, a tensor's memoryview) into the file's stream of bytes."""
        view = memoryview(data).cast("B")
        size = len(self._blocks[0])
        while len(view):
            self._raise()
            n = min(size - self._filled, len(view))
            self._blocks[self._current][self._filled:self._filled + n] = view[:n]
            self._filled += n
            self.bytes += n
            view = view[n:]
            if self._filled == size:
                self._full.put((self._current, size))
                self._current, self._filled = self._free.get(), 0

    def close(self) -> str:
        """The rest written, the thread and the file closed; the sha256 of all the bytes, in hex."""
        if self._closed:
            return self._digest.hexdigest()
        self._closed = True
        try:
            self._full.put((self._current, self._filled))
            self._full.put(_DONE)
            self._thread.join()
            self._raise()
        finally:
            self._release()
        return self._digest.hexdigest()

    def abort(self) -> None:
        """Stop without writing what is staged (the caller failed; it removes the file)."""
        if self._closed:
            return
        self._closed = True
        self._error = self._error or _Aborted()
        self._full.put(_DONE)
        self._thread.join()
        self._release()

    def __enter__(self) -> "FileOut":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _raise(self) -> None:
        if self._error is not None and not isinstance(self._error, _Aborted):
            raise self._error

    def _release(self) -> None:
        os.close(self._fd)
        for b in self._blocks:
            b.close()

    # ----- the thread: blocks in order, each hashed then written (hashlib and os.write let the caller's thread run)
    def _drain(self) -> None:
        while (item := self._full.get()) is not _DONE:
            index, n = item
            try:
                if self._error is None:
                    view = memoryview(self._blocks[index])[:n]
                    self._digest.update(view)
                    self._write_block(view)
                    view.release()
            except BaseException as e:  # noqa: BLE001  (given to the caller: _raise)
                # without this thread's frames, which hold views of the block (a mapped block with views cannot close)
                self._error = e.with_traceback(None)
            finally:
                self._free.put(index)

    def _write_block(self, view: memoryview) -> None:
        if self.direct and len(view) % ALIGN:  # the file's end: a tail that is not a whole number of pages
            self._buffered()
        while len(view):
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                # the file system took the flag at open but refuses this direct write (or a short write left the
                # offset unaligned): the page cache from here on, from where the file stands
                self._buffered()
                continue
            if self.direct:
                self.direct_bytes += n
            view = view[n:]

    def _buffered(self) -> None:
        _set_direct(self._fd, False)
        self.direct = False


class _Aborted(Exception):
    """The caller stopped: the thread drops what is staged."""


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether that worked (False where the system or the file system lacks it)."""
    if not _O_DIRECT:
        return False
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError:
        return False
    return True

