"""engine.file_out: a file written by a thread from two staging blocks, straight to the disk where the file system
takes O_DIRECT. The bytes and their sha256 are the caller's, in order, whatever the sizes; a block's write runs
while the caller goes on; errors of the thread reach the caller; a file system that refuses direct writes gets the
same bytes through the page cache."""

from __future__ import annotations

import errno
import hashlib
import os
import threading

import pytest

from halfsafe.engine import file_out
from halfsafe.engine.file_out import ALIGN, FileOut

BLOCK = 2 * ALIGN  # small blocks: every test crosses several
HANG = 300  # seconds: a deadlock guard, never a measure of speed


def _parts(seed: int = 0) -> list[bytes]:
    rng = __import__("random").Random(seed)
    sizes = [8, 1, 0, BLOCK - 9, BLOCK, 3 * BLOCK + 5, 17, ALIGN, 2 * BLOCK]
    return [rng.randbytes(n) for n in sizes]


def test_the_file_and_its_digest_are_the_bytes_in_order(tmp_path):
    parts = _parts()
    path = tmp_path / "f.bin"
    with FileOut(path, block=BLOCK) as f:
        for p in parts:
            f.write(p)
        digest = f.close()
    whole = b"".join(parts)
    assert path.read_bytes() == whole
    assert digest == hashlib.sha256(whole).hexdigest()
    assert f.bytes == len(whole)


def test_whole_blocks_go_past_the_page_cache_where_the_file_system_takes_it(tmp_path):
    path = tmp_path / "f.bin"
    f = FileOut(path, block=BLOCK)
    if not f.direct:
        f.abort()
        pytest.skip("no O_DIRECT on this file system")
    data = os.urandom(3 * BLOCK + 100)
    f.write(data)
    f.close()
    assert f.direct_bytes == 3 * BLOCK  # the tail (not whole pages) through the page cache
    assert path.read_bytes() == data


def test_the_callers_buffer_is_free_once_write_returns(tmp_path):
    """The copy into the staging block is the hand-off: what the caller does to its buffer after `write` (a tensor
    going back to the pool, refilled by the next read) never reaches the file."""
    path = tmp_path / "f.bin"
    buf = bytearray(os.urandom(BLOCK + 10))
    want = bytes(buf)
    with FileOut(path, block=BLOCK) as f:
        f.write(buf)
        buf[:] = b"\0" * len(buf)
        f.write(buf[:0])
    assert path.read_bytes() == want


def test_a_block_is_written_while_the_caller_fills_the_next(tmp_path, monkeypatch):
    """The thread's write of block 1 is held until the caller has staged all of block 2: the caller never waited.
    HANG bounds the waits only so that a FileOut whose caller waits for the thread fails instead of hanging: no
    machine, however loaded, takes that long to copy one block."""
    started, release = threading.Event(), threading.Event()
    real = os.write

    def slow_write(fd, data):
        started.set()
        assert release.wait(HANG), "the caller did not get on while the block was being written"
        return real(fd, data)

    monkeypatch.setattr(file_out.os, "write", slow_write)
    path = tmp_path / "f.bin"
    first, second = os.urandom(BLOCK), os.urandom(BLOCK - 1)
    with FileOut(path, block=BLOCK) as f:
        f.write(first)  # full: handed to the thread
        assert started.wait(HANG)
        f.write(second)  # staged in the other block while the thread is still inside the first one's write
        release.set()
    assert path.read_bytes() == first + second


@pytest.mark.parametrize("at_open", [True, False])
def test_a_file_system_refusing_direct_writes_gets_the_bytes_through_the_page_cache(tmp_path, monkeypatch, at_open):
    """Refused when O_DIRECT is set (tmpfs, some FUSE and network file systems), or only at the first direct write
    (EINVAL): the same bytes either way."""
    if at_open:
        monkeypatch.setattr(file_out, "_set_direct", lambda fd, on: False)
    else:
        real, refused = os.write, []

        def write(fd, data):
            import fcntl

            if fcntl.fcntl(fd, fcntl.F_GETFL) & file_out._O_DIRECT:
                refused.append(len(data))
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, data)

        if not file_out._O_DIRECT:
            pytest.skip("no O_DIRECT on this system")
        monkeypatch.setattr(file_out.os, "write", write)
    parts = _parts(1)
    path = tmp_path / "f.bin"
    with FileOut(path, block=BLOCK) as f:
        for p in parts:
            f.write(p)
    assert path.read_bytes() == b"".join(parts)
    assert f.direct_bytes == 0 and not f.direct


def test_a_full_disk_in_the_thread_is_raised_in_the_caller(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_out.os, "write", full)
    path = tmp_path / "f.bin"
    with pytest.raises(OSError, match="No space left"):
        with FileOut(path, block=BLOCK) as f:
            for _ in range(4):  # the first full block fails in the thread; a later write or close says so
                f.write(os.urandom(BLOCK))
    assert f._thread is not None and not f._thread.is_alive()


def test_a_failure_of_the_caller_stops_the_thread_and_is_not_masked(tmp_path):
    path = tmp_path / "f.bin"
    with pytest.raises(ValueError, match="the caller's own"):
        with FileOut(path, block=BLOCK) as f:
            f.write(os.urandom(BLOCK + 3))
            raise ValueError("the caller's own")
    assert not f._thread.is_alive()
