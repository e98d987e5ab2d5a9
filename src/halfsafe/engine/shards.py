"""The safetensors files of a checkpoint folder, read one tensor at a time.

The files and tensors are the ones transformers' loader reads (engine.weight_files); halfsafe never unpickles: a
folder holding only `.bin`/`.pt` weights is refused with the command that turns it into safetensors. A shard named
in the index but absent, a file whose header does not parse, a tensor of a type halfsafe does not read, is a
one-line error before any work starts. Every file the checkpoint names is resolved inside the folder
(`files.model_folder.inside`), and a shard larger than this machine can map is refused before it is opened.
"""

from __future__ import annotations

import math
import os
import resource
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import HalfsafeError
from ..files.model_folder import inside
from .pool import Pool
from .weight_files import file_of_each_key

READ_BYTES = 32 << 20  # a tensor larger than this (as stored) is read in blocks of rows this size


def mappable_bytes() -> int | None:
    """The largest file safetensors can map here (it maps a shard private and writable, which the kernel counts
    against memory), or None when there is no limit: the address-space limit, and the overcommit policy's
    (heuristic: RAM plus swap for one mapping; strict: what the commit limit leaves)."""
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    try:
        mode = int(Path("/proc/sys/vm/overcommit_memory").read_text())
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
                if k in ("MemTotal", "SwapTotal", "CommitLimit", "Committed_AS")}
    except (OSError, ValueError):
        return min(limits, default=None)
    if mode == 0:
        limits.append(info["MemTotal"] + info["SwapTotal"])
    elif mode == 2:
        limits.append(info["CommitLimit"] - info["Committed_AS"])
    return min(limits, default=None)


def check_mappable(path: Path) -> None:
    size = os.stat(path).st_size
    limit = mappable_bytes()
    if limit is not None and size > limit:
        raise HalfsafeError(f"{path} is {size / 1e9:.1f} GB, more than this machine can map ({limit / 1e9:.1f} GB of memory): "
                            "re-save the checkpoint in smaller shards (save_pretrained(max_shard_size=...)) or add memory or swap")


class Shards:
    """`key -> tensor` over a folder's safetensors files: `shape`/`dtype` from the headers, `load` reads one
    tensor (a file stays open only inside `with shards:`, so nothing stays mapped between units)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.file_of = _file_of_each_key(self.folder)
        self._paths = {name: inside(self.folder, name) for name in set(self.file_of.values())}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name in sorted(self._paths):
            try:
                with safe_open(self._paths[name], "pt") as f:
                    for key in f.keys():
                        if self.file_of.get(key) == name:
                            s = f.get_slice(key)
                            self._meta[key] = (tuple(s.get_shape()), _dtype(self.folder / name, key, s.get_dtype()))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise HalfsafeError(f"{self.folder / name} is not a readable safetensors file ({_first_line(e)}): "
                                    "re-download or re-save the checkpoint") from None
        missing = [k for k in self.file_of if k not in self._meta]
        if missing:  # the header read changed under us
            raise HalfsafeError(f"{self.folder / self.file_of[missing[0]]} does not hold {missing[0]} as its header said: "
                                "the checkpoint changed while halfsafe read it; run again once it is complete")
        self._open: dict[str, object] = {}
        self._stack: ExitStack | None = None
        self.bytes_read = 0  # bytes of stored tensors read so far, as stored (engine.reads turns them into passes)
        self.pool: Pool | None = None  # where `load` takes its tensors from first (a streamed model's: engine.pool)

    def stored_bytes(self, key: str) -> int:
        return math.prod(self.shape(key)) * self.dtype(key).itemsize

    def keys(self) -> list[str]:
        return list(self._meta)

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key][1]

    def path(self, key: str) -> Path:
        """The file holding `key`, resolved inside the folder."""
        return self._paths[self.file_of[key]]

    def __enter__(self):
        """`with shards: ...` keeps the files open for a batch of loads (one unit's tensors)."""
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc):
        self._open.clear()
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def load(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored tensor in `dtype` (floating tensors only; default: as stored), a fresh CPU tensor that owns
        its memory (safetensors hands out views of the mapped file, which must not be written to or kept).
        A large tensor is read a block of rows at a time, each from its own opening of the file: the mapped file
        pages a read touches count in the process's memory until the file closes."""
        name = self.file_of[key]
        shape = self.shape(key)
        stored = self.dtype(key)
        want = dtype if dtype is not None and stored.is_floating_point else stored
        out = self.pool.take(shape, want) if self.pool is not None and want.is_floating_point else None
        if len(shape) >= 2 and math.prod(shape) * stored.itemsize > READ_BYTES:
            out = torch.empty(shape, dtype=want) if out is None else out
            for a, b in row_spans(shape[0], rows_per_read(shape, stored.itemsize)):
                self._rows_into(key, a, b, out[a:b])
            return out
        self.bytes_read += math.prod(shape) * stored.itemsize
        if self._stack is not None:
            f = self._open.get(name)
            if f is None:
                f = self._open[name] = self._stack.enter_context(safe_open(self._paths[name], "pt"))
            return _owned(f.get_tensor(key), dtype, out)
        with safe_open(self._paths[name], "pt") as f:
            return _owned(f.get_tensor(key), dtype, out)

    def load_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows [start, stop) of the stored tensor, as `load` gives the whole. The file is opened for this read
        alone: only these rows' pages are ever mapped."""
        shape, stored = self.shape(key), self.dtype(key)
        stop = min(stop, shape[0])
        start = min(start, stop)
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype if dtype is not None and stored.is_floating_point else stored)
        self._rows_into(key, start, stop, out)
        return out

    def _rows_into(self, key: str, start: int, stop: int, dest: torch.Tensor) -> None:
        """Rows [start, stop) (within the tensor) written into `dest`, cast as `copy_` casts (the single rounding `.to`
        makes): a block of a large tensor goes straight into its place."""
        self.bytes_read += (stop - start) * math.prod(self.shape(key)[1:]) * self.dtype(key).itemsize
        with safe_open(self._paths[self.file_of[key]], "pt") as f:
            dest.copy_(f.get_slice(key)[start:stop])

    def load_index(self, key: str, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored rows `rows` (sorted, distinct), stacked in that order; runs of consecutive rows are read at once."""
        rows = rows.tolist()
        runs, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                runs.append((rows[start], rows[i - 1] + 1))
                start = i
        self.bytes_read += sum(b - a for a, b in runs) * math.prod(self.shape(key)[1:]) * self.dtype(key).itemsize
        with safe_open(self._paths[self.file_of[key]], "pt") as f:
            s = f.get_slice(key)
            parts = [_owned(s[a:b], dtype) for a, b in runs]
        if not parts:
            return torch.empty((0, *self.shape(key)[1:]), dtype=dtype or self.dtype(key))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_spans(n: int, step: int) -> list[tuple[int, int]]:
    """[start, stop) spans of `step` rows covering `n` rows (the last may be shorter)."""
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def rows_per_read(shape, itemsize: int) -> int:
    """Rows of a tensor of `shape` in one READ_BYTES block at `itemsize` bytes an element (at least one)."""
    return max(1, READ_BYTES // (math.prod(shape[1:]) * itemsize))


def _owned(t: torch.Tensor, dtype: torch.dtype | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of the mapped `t` in `dtype` (floating tensors), into `out` where given (`copy_` rounds as `to` does)."""
    if out is not None:
        return out.copy_(t)
    if dtype is None or not t.is_floating_point() or t.dtype == dtype:
        return t.clone()
    return t.to(dtype)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _dtype(path: Path, key: str, stored: str) -> torch.dtype:
    """The torch dtype of a stored tensor's safetensors dtype; one halfsafe does not read (U16, U32, U64, the 4- and
    6-bit floats ...) is refused naming the tensor, before any work starts."""
    dtype = _DTYPES.get(stored)
    if dtype is None:
        raise HalfsafeError(f"{path} stores {key} as {stored}, a type halfsafe does not read ({', '.join(_DTYPES)}): "
                            "re-save the checkpoint in bfloat16 or float32 (save_pretrained after .to(torch.bfloat16))")
    return dtype


def _file_of_each_key(folder: Path) -> dict[str, str]:
    """key -> the file holding it, as transformers' loader takes it (engine.weight_files), every file resolved inside
    `folder` and small enough to map."""
    file_of = file_of_each_key(folder)
    for name in sorted(set(file_of.values())):
        check_mappable(inside(folder, name))
    return file_of


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
