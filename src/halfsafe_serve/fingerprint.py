"""The fingerprint of what halfsafe wrote: sha256 of config.json and of every weight file, recorded in halfsafe.json.

A folder is fp16-safe by halfsafe's say only while its weights are the ones the record describes: a fine-tune saved
over it, an edited shard, or a halfsafe.json copied next to other weights no longer match. `record_of(folder)` says
which, in one line that names `halfsafe apply` (the way to make other weights fp16-safe), or returns the record.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FILE = "halfsafe.json"
KEY = "fingerprint"  # halfsafe.json's field: {"sha256": {file name: hex digest}}
RECORD_FORMAT = 1  # the newest halfsafe.json format this reader knows (halfsafe.io.report.RECORD_FORMAT)
# what the fingerprint covers: the config and anything a loader could take weights from, at the folder's top level
_COVERED = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
            "*.gguf")
WEIGHTLESS = {"config.json"}  # covered, but no weights: a folder holding only these has nothing to fingerprint
_BLOCK = 1 << 24
_known: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256 of a file whose bytes were hashed as written


def covered(folder: Path) -> list[str]:
    """The names of the files in `folder` the fingerprint covers, sorted: every entry so named but a folder (a FIFO
    named model-extra.safetensors is one a loader would open; it is counted, never opened)."""
    return sorted({p.name for pattern in _COVERED for p in Path(folder).glob(pattern) if not p.is_dir()})


def _stat_key(path: Path) -> tuple[str, int, int]:
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns


def remember(path: Path, sha256: str) -> None:
    """The digest of a file just written, hashed as its bytes went out (engine.write): not read back again."""
    _known[_stat_key(path)] = sha256


def sha256_file(path: Path) -> str:
    known = _known.get(_stat_key(path))
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def fingerprint(folder: Path, keep: bool = False) -> dict:
    """The fingerprint of `folder` as written now: the value of halfsafe.json's `fingerprint` field. `keep`: remember
    each digest (halfsafe, in the folder it is writing: the seal after the last file reads none of them again)."""
    digests = {name: sha256_file(Path(folder) / name) for name in covered(folder)}
    if keep:
        for name, digest in digests.items():
            remember(Path(folder) / name, digest)
    return {"sha256": digests}


class NotVerified(Exception):
    """Why a folder is not one halfsafe made fp16-safe, as it stands (one line)."""


_APPLY = "to serve other weights in float16, make them fp16-safe with `halfsafe apply OUT/halfsafe.json WEIGHTS OUT2`"


def fp16_safe(record: dict) -> bool:
    """Whether the record says the weights it describes run in float16 (convert/finetune: finite on calibration, nothing
    left above float16's range, the check after a fine-tune finite; apply: its scan says fp16-safe)."""
    if "applied_plan_from" in record:
        return (record.get("scan_after") or {}).get("fp16_safe") is True
    ok = record.get("fp16_finite_on_calibration") is True and not record.get("unfixable")
    if "finetune" in record:
        ok = ok and (record.get("fp16_check_after_finetune") or {}).get("finite") is True
    return ok


def verified_record(folder: str | Path, digests: dict | None = None) -> dict:
    """halfsafe.json of `folder` when it says the folder is fp16-safe and the folder's weights are the ones it
    fingerprinted; else NotVerified with the reason (no halfsafe.json at all: NotVerified too, `.absent` set).
    `digests`: {name: sha256} of files known unchanged since they were hashed (halfsafe_serve.verified's cache), used
    instead of reading them again; every other check runs as without them."""
    folder = Path(folder)
    path = folder / FILE
    if not path.is_file():
        err = NotVerified(f"{folder} has no {FILE}")
        err.absent = True  # type: ignore[attr-defined]
        raise err
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise NotVerified(f"{path} cannot be read ({type(e).__name__})") from None
    if not isinstance(record, dict) or "plan" not in record:
        raise NotVerified(f"{path} is not a record halfsafe wrote")
    version = record.get("format", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= RECORD_FORMAT:
        raise NotVerified(f"{path} is format {version!r}, newer than this halfsafe reads: upgrade halfsafe")
    if not fp16_safe(record):
        raise NotVerified(f"{path} does not say these weights are fp16-safe")
    recorded = (record.get(KEY) or {}).get("sha256") if isinstance(record.get(KEY), dict) else None
    if not isinstance(recorded, dict) or not recorded:
        raise NotVerified(f"{path} holds no fingerprint of the weights it describes (written by halfsafe "
                          f"{record.get('halfsafe_version', '?')}, before fingerprints); {_APPLY}")
    present = covered(folder)
    if sorted(recorded) != present:
        missing, extra = sorted(set(recorded) - set(present)), sorted(set(present) - set(recorded))
        what = "; ".join(s for s in (f"missing {', '.join(missing)}" if missing else "",
                                      f"not written by halfsafe: {', '.join(extra)}" if extra else "") if s)
        raise NotVerified(f"{folder}'s weights are not the ones its {FILE} describes ({what}); {_APPLY}")
    for name in present:
        if not (folder / name).is_file():  # a FIFO, a device, a dangling link: never opened (a FIFO blocks its reader)
            raise NotVerified(f"{folder}/{name} is not a regular file, so not the file halfsafe wrote; {_APPLY}")
    for name in present:
        digest = (digests or {}).get(name) or sha256_file(folder / name)
        if digest != recorded[name]:
            raise NotVerified(f"{folder}/{name} is not the file halfsafe wrote (a fine-tune saved over it, an edited file, "
                              f"or a {FILE} copied next to other weights); {_APPLY}")
    return record
