"""fp16 ONNX of a converted checkpoint, for ONNX Runtime and transformers.js: no Clip nodes, no fp32 islands added.

The one entry point of the ONNX export (`export`): `halfsafe export onnx` writes a fresh OUT (`export_onnx`),
`convert --to onnx` adds the graphs to the checkpoint's temporary folder before it becomes OUT (`add_onnx`); the
work between is the same. The registry (halfsafe.export.exporters) picks the exporter for the model (decoder,
encoder or encoder-decoder: halfsafe.export.contract says what each gives); each writes the file layout of a
transformers.js model (config, generation config, tokenizer, `onnx/*_fp16.onnx`) with the model card's ONNX section.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import HalfsafeError
from ..requests import ExportRequest
from ..runtime.profiles import RuntimeProfile, SplitK, export_profile, get_profile
from .contract import Exporter
from .exporters import exporter_for_folder
from .onnx_common import EXPORTER, ONNX_FILE, inspect_file, require_onnx, save_program, versions
from .onnx_folder import copy_side_files
from .onnx_rewrites import rewrite_for, split_graph

log = logging.getLogger(__name__)


@dataclass
class OnnxExportReport:
    path: str  # the .onnx file
    converted: bool  # the source carries halfsafe.json
    warning: str | None
    model_type: str
    inputs: list[str]
    outputs: list[str]
    clip_nodes: int
    initializer_dtypes: dict[str, int]  # dtype -> count
    fp16_weight_bytes: int
    file_bytes: int  # .onnx plus external data
    external_data: bool
    exporter: str = EXPORTER
    versions: dict[str, str] = field(default_factory=dict)
    runtime: str = "torch"
    norm_prescales: dict[str, dict] = field(default_factory=dict)  # --runtime P: per norm, its peak and c = 2^-shift
    head_groups: int = 1  # --runtime P with float16 accumulation: the head's K in this many products (onnx_accumulate)
    split_k: dict = field(default_factory=dict)  # the split-K rule, products split per kind and their groups by K

    def to_dict(self) -> dict:
        return asdict(self)


def check_source(source: str | Path) -> Path:
    folder = Path(source).expanduser()
    if not folder.exists():
        raise HalfsafeError(f"{source} does not exist: give the folder `halfsafe convert` wrote")
    if not folder.is_dir():
        raise HalfsafeError(f"{source} is not a folder: give the folder `halfsafe convert` wrote (config.json + *.safetensors)")
    return folder


def check_folder_exportable(folder: str | Path) -> None:
    """Refuse, before `convert --to onnx` spends its time converting, a local model the export does not cover."""
    folder = Path(folder).expanduser()
    if (folder / "config.json").is_file():
        exporter_for_folder(folder)


def not_converted_warning(folder: Path) -> str | None:
    """The line to warn with when `folder` was not written by `halfsafe convert` (no halfsafe.json)."""
    if (folder / "halfsafe.json").is_file():
        return None
    return (
        f"{folder} has no halfsafe.json: it was not converted by halfsafe, so its fp16 ONNX may overflow (inf/NaN); "
        f"`halfsafe scan {folder} --fp16-check` reports its peaks against 65504, `halfsafe convert` fixes them"
    )


def scan_summary(folder: Path, seq_len: int = 128, max_samples: int = 2) -> str:
    """What `halfsafe scan` reports for `folder`, in one line (a short scan of the embedded text)."""
    from ..calibration import make_samples, read_texts
    from ..io.loading import load_model
    from ..scan import scan

    loaded = load_model(folder)
    samples = make_samples(read_texts(None), loaded.tokenizer, loaded.model.config.get_text_config().vocab_size, seq_len, max_samples)
    report = scan(loaded.model, samples, progress=False, name=str(folder))
    peak = report.peak
    verdict = "fits in" if report.fp16_safe else "overflows"
    return f"`halfsafe scan` ({report.n_tokens} tokens): largest |activation| {peak.abs_max:.4g} at {peak.name}, {verdict} fp16's 65504"


def export(source: str | Path, out: str | Path | None = None, *, runtime: RuntimeProfile | str | None = None,
           split_k: SplitK | None = None, overwrite: bool = False, scan: bool = False,
           final: str | Path | None = None) -> OnnxExportReport:
    """The ONNX export of the checkpoint in `source`: into a fresh folder `out` (with `source`'s side files, written
    whole or not at all; `overwrite`: an OUT halfsafe wrote may be replaced), or, `out` None, into `source` itself,
    beside its weights (`final`: where that folder will be once complete, which the report's path and the card name).
    `runtime`: a profile (or its name) whose float16 arithmetic the graph is rewritten for (onnx_rewrites), its
    products split as `split_k` says (None: profiles.export_profile's default; SplitK(): the plain graph); `scan`:
    an unconverted source's warning says what `halfsafe scan` finds."""
    from ..io.checkpoint import check_out_dir

    profile = export_profile(get_profile(runtime), split_k)
    folder = check_source(source)
    if out is not None:
        out = check_out_dir(out, overwrite, inputs=[folder])
    require_onnx()
    warning = not_converted_warning(folder)
    if warning and scan:
        warning += "; " + scan_summary(folder)
    if warning:
        log.warning(warning)  # before the slow part
    exporter = exporter_for_folder(folder)
    model = exporter.load_fp16(folder)
    prescales, groups = rewrite_for(profile, model, folder)
    if out is None:  # into the folder given, which will be at `final`
        place = Path(final) if final is not None else folder
        rel, split = _write_graphs(exporter, model, profile, folder, place.name)
        report = report_for(folder / rel, model.config.model_type, converted=warning is None, warning=warning)
        report.path = str(place / rel)
    else:
        rel, split = _write_new_folder(exporter, model, profile, folder, out, overwrite)
        report = report_for(out / rel, model.config.model_type, converted=warning is None, warning=warning)
    report.runtime, report.norm_prescales, report.head_groups, report.split_k = profile.name, prescales, groups, split
    return report


def report_for(path: Path, model_type: str, converted: bool, warning: str | None = None) -> OnnxExportReport:
    """The report of the graph file at `path`."""
    info = inspect_file(path)
    return OnnxExportReport(path=str(path), converted=converted, warning=warning, model_type=model_type, versions=versions(), **info)


def _write_new_folder(exporter: Exporter, model, profile: RuntimeProfile, source: Path, out: Path,
                      overwrite: bool) -> tuple[str, dict]:
    """A new folder at `out` (atomic: whole or absent): `source`'s side files and the graphs."""
    from ..io.checkpoint import atomic_folder

    try:
        with atomic_folder(out, replace=overwrite) as tmp:
            copy_side_files(source, tmp)
            return _write_graphs(exporter, model, profile, tmp, out.name)
    except OSError as e:
        raise HalfsafeError(f"could not write {out} ({e.strerror or e}): nothing was left behind; free some space or "
                            "choose another output folder") from None


def _write_graphs(exporter: Exporter, model, profile: RuntimeProfile, folder: Path, name: str) -> tuple[str, dict]:
    """The exporter's graphs into `folder`/onnx/ (all of them or none), each rewritten for `profile`, then its
    config, tokenizer and card edits (`name`: the folder's name once in place), and `folder` sealed (halfsafe.json
    lists every file). Returns the last graph written (the decoder of an encoder-decoder), relative to `folder`,
    and the split-K counts."""
    from ..io.checkpoint import atomic_folder
    from ..io.report import seal

    split: dict = {}
    onnx_dir = folder / Path(ONNX_FILE).parent
    with atomic_folder(onnx_dir, replace=True, inner=True) as tmp:  # `folder`'s record covers onnx/
        for rel, program in exporter.programs(model):  # one graph in memory at a time
            split_graph(profile, program, split)
            save_program(program, tmp / Path(rel).name)
            del program
    exporter.finish(folder, name)
    seal(folder)
    return rel, split


def run_export(request: ExportRequest) -> OnnxExportReport:
    """`halfsafe export onnx`: the request's checkpoint as an fp16 ONNX model folder, for its runtime profile."""
    return export(request.converted, request.out, runtime=request.runtime, split_k=request.split_k,
                  overwrite=request.overwrite, scan=request.scan)


def export_onnx(source: str | Path, out: str | Path, overwrite: bool = False, scan: bool = False,
                runtime: RuntimeProfile | str | None = None, split_k: SplitK | None = None) -> OnnxExportReport:
    """`halfsafe export onnx SOURCE OUT`: the checkpoint `halfsafe convert` wrote, as an fp16 ONNX model folder."""
    return export(source, out, runtime=runtime, split_k=split_k, overwrite=overwrite, scan=scan)


def add_onnx(folder: str | Path, runtime: RuntimeProfile | str | None = None,
             final: str | Path | None = None, split_k: SplitK | None = None) -> OnnxExportReport:
    """`halfsafe convert --to onnx`: the ONNX files added to a converted checkpoint folder (the save's temporary
    folder, at `final` once complete), beside its weights: a model repository that serves both transformers and
    transformers.js."""
    return export(folder, runtime=runtime, split_k=split_k, final=final)
