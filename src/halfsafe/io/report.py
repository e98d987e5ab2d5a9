"""halfsafe.json: the one record of what halfsafe did to a checkpoint, as typed data, written and read only here.

Every folder halfsafe writes carries it (a record, with its files list, marks the folder as halfsafe's: see
`checkpoint.check_out_dir`):
the versions that wrote it, the source, then what was done. `halfsafe convert` records a `Conversion` (the plan
and everything measured to choose and check it); `halfsafe finetune` the same and a `Finetuned` section after it;
`halfsafe apply` an `Applied` (a saved plan re-applied, and the scan after it). The model card (`io.card`) is made
from the same record, so the card and the file cannot say different things.

Last comes `files`: every file halfsafe wrote in the folder, with its size and its sha256 (`seal`, once everything
is written; `export onnx` and `convert --to onnx` list theirs again). `--overwrite` replaces a folder only while it
holds nothing else and every file holds the bytes listed (io.checkpoint). A record written before the digests (sizes
only) or before the list still reads as a record; --overwrite refuses to replace its folder (it cannot tell a file
halfsafe wrote from one saved over it at the same size). The listing's new shape is no new format: what the format
number guards (the plan, read by `apply` and serving engines; the measurements) is as it was, and an older halfsafe
meeting the new listing refuses the record in one line, so its --overwrite leaves the folder as it is.

The file is versioned as the plan is: `format`, left out while it is 1 (as format-1 plans left theirs out, and
every halfsafe.json so far is format 1); a reader refuses a newer format than it knows in one line. The keys are
written in the order below, the same bytes for the same run, whatever version of this module wrote them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn

from .._version import __version__
from ..core.margin import Margin
from ..core.plan import Plan
from ..errors import HalfsafeError
from .owned import MARK as FOLDER_MARK

FILE = "halfsafe.json"
RECORD_FORMAT = 1  # raise with any change to the layout below; format 1 is written without the field


@dataclass
class Versions:
    """Of the halfsafe, transformers and torch that wrote the record (written first, as *_version)."""

    halfsafe: str
    transformers: str
    torch: str

    @classmethod
    def current(cls) -> "Versions":
        import torch
        import transformers

        return cls(__version__, transformers.__version__, torch.__version__)

    def to_dict(self) -> dict:
        return {f"{k}_version": v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Versions":
        return cls(*(str(d.get(f"{f.name}_version", "")) for f in fields(cls)))


@dataclass
class Conversion:
    """What `halfsafe convert` chose and measured (convert.ConversionReport's part that is saved)."""

    plan: Plan
    margin: Margin | None
    peaks_before: dict[str, float]  # residual peak per block, float32, before
    peaks_after: dict[str, float]  # predicted residual peak per block after the plan
    peak_before: float  # the largest activation before
    unfixable: list[dict]  # {"site", "abs_max"}: still above 65504
    below_headroom_target: list[dict]  # {"site", "abs_max"}: under 65504 but inside the margin
    candidates: list[dict]  # convert.Candidate's fields, each plan tried
    tensor_storage: list[dict]  # {"param", "before", "after"}: fp16 storage error of every moved tensor
    fp32_output_change: float
    fp16_finite_on_calibration: bool
    notes: list[str] = field(default_factory=list)
    runtime: dict | None = None  # convert --runtime only
    checkpoint_reads: dict | None = None  # a streamed model only: passes over its checkpoint per phase
    fp16_arith: dict | None = None  # how the candidates' float16 ran (torch runtime only)
    calib_arith: dict | None = None  # how the calibration's matrix products ran (halfsafe.engine.calib_arith)

    _OPTIONAL = ("runtime", "checkpoint_reads", "fp16_arith", "calib_arith")  # left out when None; margin is written as null

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"plan": self.plan.to_dict(), "margin": self.margin.to_dict() if self.margin else None}
        for f in fields(self)[2:]:
            value = getattr(self, f.name)
            if value is not None or f.name not in self._OPTIONAL:
                d[f.name] = value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Conversion":
        margin = d.get("margin")
        return cls(Plan.from_dict(d["plan"]), Margin(**margin) if margin else None,
                   **{f.name: d[f.name] for f in fields(cls)[2:] if f.name in d})


@dataclass
class ScanAfter:
    """`halfsafe apply`'s scan of the result: fp16-safe, and whether the plan's margin was kept."""

    fp16_safe: bool
    first_nonfinite_fp16: str | None
    peak_site: str
    headroom_bits: float
    margin_kept: bool


@dataclass
class Applied:
    """A saved plan re-applied to another checkpoint (`halfsafe apply`)."""

    plan_from: str  # the plan.json or converted folder it came from
    plan: Plan
    peak_after: float
    scan_after: ScanAfter
    tensor_storage: list[dict]

    def to_dict(self) -> dict:
        return {"applied_plan_from": self.plan_from, "plan": self.plan.to_dict(), "peak_after": self.peak_after,
                "scan_after": asdict(self.scan_after), "tensor_storage": self.tensor_storage}

    @classmethod
    def from_dict(cls, d: dict) -> "Applied":
        return cls(d["applied_plan_from"], Plan.from_dict(d["plan"]), d["peak_after"], ScanAfter(**d["scan_after"]),
                   d["tensor_storage"])


@dataclass
class FinetuneReport:
    """What `halfsafe finetune` did after the exact rescaling (training.finetune)."""

    steps: int  # optimizer steps taken in total (including those before a resume)
    stop_reason: str
    threshold: float
    target: float
    watched: list[str]
    trainable: list[str]
    peaks_before: dict[str, float]  # float32 |x| max over the samples, watched sites
    peaks_after: dict[str, float]
    max_peak_after: float  # over every site
    max_site_after: str
    kl: float  # mean KL(teacher || student) per token over the samples, after
    converged: bool
    resumed_from_step: int | None = None
    history: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Finetuned:
    """The fine-tune and the float16 check after it (training.finetune.fp16_check's dict)."""

    report: FinetuneReport
    fp16_check: dict  # {"finite", "peak", "peak_site", "tokens"}

    def to_dict(self) -> dict:
        return {"finetune": self.report.to_dict(), "fp16_check_after_finetune": self.fp16_check}

    @classmethod
    def from_dict(cls, d: dict) -> "Finetuned":
        return cls(FinetuneReport(**d["finetune"]), d["fp16_check_after_finetune"])


@dataclass
class Record:
    """halfsafe.json. A conversion (convert, finetune) or an applied plan (apply), never both."""

    source: str
    conversion: Conversion | None = None
    finetuned: Finetuned | None = None  # after a conversion only
    applied: Applied | None = None
    versions: Versions = field(default_factory=Versions.current)
    format: int = RECORD_FORMAT
    fingerprint: dict | None = None  # what was written (halfsafe_serve.fingerprint), set by `write`; before `files`
    # every file halfsafe wrote in the folder but this one: path -> {"bytes", "sha256"} (`files_in`); a record from
    # before the digests holds path -> bytes
    files: dict[str, dict | int] | None = None

    def __post_init__(self) -> None:
        if (self.conversion is None) == (self.applied is None) or (self.finetuned and not self.conversion):
            raise ValueError("a record holds a conversion (and perhaps a fine-tune after it) or an applied plan")

    @property
    def plan(self) -> Plan:
        return self.conversion.plan if self.conversion is not None else self.applied.plan  # type: ignore[union-attr]

    def to_dict(self) -> dict:
        done = [s.to_dict() for s in (self.conversion, self.finetuned, self.applied) if s is not None]
        return {**({"format": self.format} if self.format != 1 else {}), **self.versions.to_dict(), "source": self.source,
                **{k: v for d in done for k, v in d.items()}, **({"fingerprint": self.fingerprint} if self.fingerprint else {}),
                **({"files": self.files} if self.files is not None else {})}

    @classmethod
    def from_dict(cls, d: object) -> "Record":
        """A record read back, refused in one line when it is not one (its plan by `Plan.from_dict`'s check)."""
        if not isinstance(d, dict) or "plan" not in d:
            _refuse("it is not an object with a plan")
        version = d.get("format", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            _refuse(f"its format is {version!r}, not a format number")
        if version > RECORD_FORMAT:
            raise HalfsafeError(f"this {FILE} is format {version}, written by halfsafe {d.get('halfsafe_version', '?')}; "
                                f"this halfsafe reads formats up to {RECORD_FORMAT}: upgrade halfsafe")
        fingerprint = d["fingerprint"] if isinstance(d.get("fingerprint"), dict) else None
        files = d.get("files")
        if files is not None and not _is_listing(files):
            _refuse("its files are not a list of file names with their sizes and digests")
        try:
            if "applied_plan_from" in d:
                return cls(str(d.get("source")), applied=Applied.from_dict(d), versions=Versions.from_dict(d), format=version,
                           fingerprint=fingerprint, files=files)
            return cls(str(d.get("source")), Conversion.from_dict(d), Finetuned.from_dict(d) if "finetune" in d else None,
                       versions=Versions.from_dict(d), format=version, fingerprint=fingerprint, files=files)
        except (KeyError, TypeError) as e:
            _refuse(f"{type(e).__name__}: {e}")


def write(folder: Path, record: Record | None) -> None:
    """`folder`/halfsafe.json, written after the weights and config. A record made by this run gets the fingerprint of
    what is in `folder` now (what lets a serving engine trust it: halfsafe_serve); one read back keeps its own.
    None: only the versions (a folder halfsafe wrote without a plan: its engine's tests)."""
    from halfsafe_serve.fingerprint import WEIGHTLESS, fingerprint

    if record is not None and record.fingerprint is None:
        made = fingerprint(Path(folder), keep=True)
        record = replace(record, fingerprint=made if set(made["sha256"]) - WEIGHTLESS else None)
    d = record.to_dict() if record is not None else Versions.current().to_dict()
    (Path(folder) / FILE).write_text(json.dumps(d, indent=2, allow_nan=True) + "\n")


def read(path: str | Path) -> Record:
    """The record in `path` (a converted folder, or its halfsafe.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise HalfsafeError(f"cannot read {path} ({type(e).__name__}): pass a folder halfsafe wrote") from None
    return Record.from_dict(d)


def _is_size(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_entry(v: object) -> bool:
    """A listed file: {"bytes": size, "sha256": 64 lowercase hex digits}, or a size alone (a record from before the
    digests)."""
    if _is_size(v):
        return True
    return (isinstance(v, dict) and sorted(v) == ["bytes", "sha256"] and _is_size(v["bytes"])
            and isinstance(v["sha256"], str) and len(v["sha256"]) == 64 and all(c in "0123456789abcdef" for c in v["sha256"]))


def _is_listing(files: object) -> bool:
    return isinstance(files, dict) and all(isinstance(k, str) and k and _is_entry(v) for k, v in files.items())


def files_in(folder: Path) -> dict[str, dict]:
    """Every plain file under `folder` but its halfsafe.json (and a mark io.owned keeps there while it is written), as
    relative path -> {"bytes": size, "sha256": digest}, in sorted order; symbolic links are not followed. A weight file
    the write hashed as it went out is not read again (halfsafe_serve.fingerprint.remember)."""
    from halfsafe_serve.fingerprint import sha256_file

    folder = Path(folder)
    found = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            st = os.lstat(path)
            if rel in (FILE, FOLDER_MARK) or not stat.S_ISREG(st.st_mode):
                continue
            found[rel] = {"bytes": st.st_size, "sha256": sha256_file(path)}
    return dict(sorted(found.items()))


def seal(folder: Path) -> None:
    """Write into `folder`/halfsafe.json, once everything halfsafe writes there is written, what the folder now holds:
    the files with their digests (`Record.files`: --overwrite replaces the folder only while it holds these bytes and
    no other file) and, where the record has one, the fingerprint of its weights and config (config.json is edited
    after the record for transformers.js by `convert --to onnx`; an ONNX export holds no weights, so its copied record
    loses the fingerprint). Every other key keeps its place and its bytes; a halfsafe.json that is not a record (or
    none) is left as it is."""
    from halfsafe_serve.fingerprint import KEY, WEIGHTLESS, fingerprint

    path = Path(folder) / FILE
    if path.is_symlink() or not path.is_file():
        return
    try:
        d = json.loads(path.read_text())
        Record.from_dict(d)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError, HalfsafeError):
        return
    d.pop("files", None)
    if KEY in d:
        made = fingerprint(Path(folder), keep=True)
        if set(made["sha256"]) - WEIGHTLESS:
            d[KEY] = made
        else:
            del d[KEY]
    d["files"] = files_in(folder)
    tmp = path.with_name(f".{FILE}.tmp")
    tmp.write_text(json.dumps(d, indent=2, allow_nan=True) + "\n")
    os.replace(tmp, path)


def _refuse(why: str) -> NoReturn:
    raise HalfsafeError(f"not a {FILE} halfsafe wrote ({why}): pass a folder halfsafe wrote, its {FILE} unedited")
