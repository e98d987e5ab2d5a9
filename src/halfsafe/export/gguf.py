"""llama.cpp GGUF of a converted checkpoint, written by llama.cpp's own `convert_hf_to_gguf.py`, and a check.

llama.cpp's converter upcasts bf16 tensors to fp32 before its per-model edits, but leaves fp16 tensors fp16: for
Gemma it then adds 1 to every norm gain (Gemma's RMSNorm computes `x * (1 + w)`) in fp16, which rounds. A
halfsafe checkpoint is fp16 and its Gemma gains are stored as `(1 + w) * 2**k - 1`, so that sum would be rounded
where transformers computes `1.0 + w.float()` in fp32. `prepare_for_llama_cpp` gives the converter a copy with
the 1-D tensors (norm gains, biases) in fp32, exactly the values of the fp16 checkpoint: then its `+ 1` is the
same fp32 sum transformers makes, and every matrix stays the checkpoint's own fp16 bits.

llama.cpp is not a dependency: `scripts/setup-llama-cpp` unpacks a pinned llama-cpp-python source package's
`vendor/llama.cpp` (the converter and gguf-py of the release it builds) into halfsafe's cache, where `export_gguf`
finds it; or pass the folder of a llama.cpp checkout that holds `convert_hf_to_gguf.py` and `gguf-py`. The converter
runs in a subprocess of this python (no code of the model folder: `check_folder` refuses `auto_map` first, and the
converter sees only a copy), offline, writing into a temporary file beside OUT that becomes OUT once every tensor it
stored is the checkpoint's own.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..engine.shards import Shards
from ..errors import HalfsafeError
from ..families import family_for
from ..io.cache import cache_dir

LLAMA_CPP_ENV = "HALFSAFE_LLAMA_CPP_DIR"  # a llama.cpp checkout to take the converter from, over the cache's
SETUP_STAMP = ".halfsafe-llama-cpp"  # written last by scripts/setup-llama-cpp: a folder without it is unfinished
GGUF_MAGIC = b"GGUF"


def _shards(converted: Path) -> Shards:
    """The checkpoint's tensors through the one reader of a model folder (engine.shards: every file resolved inside
    the folder, nothing unpickled); a folder without safetensors is refused in one line."""
    if not any(converted.glob("*.safetensors")):
        raise HalfsafeError(f"{converted} has no *.safetensors: give the folder `halfsafe convert` wrote")
    return Shards(converted)


def prepare_for_llama_cpp(converted: str | Path, out: str | Path) -> Path:
    """Copy `converted` to `out` with every 1-D floating tensor in fp32 (exact); everything else unchanged, each
    weight file under its own name (the index still names them)."""
    from safetensors.torch import save_file

    from ..io.trust import check_folder

    converted, out = Path(converted), Path(out)
    check_folder(converted)  # nothing copied from outside it
    shards = _shards(converted)
    out.mkdir(parents=True, exist_ok=True)
    for f in converted.iterdir():  # not the weights, a GGUF beside them, or a temporary file halfsafe is writing there
        if f.is_file() and f.suffix not in (".safetensors", ".gguf") and not f.name.startswith(".halfsafe-"):
            shutil.copy2(f, out / f.name)
    for name in sorted(set(shards.file_of.values())):
        with shards:
            tensors = {k: shards.load(k) for k in shards.keys() if shards.file_of[k] == name}
        tensors = {k: (v.float() if v.dim() == 1 and v.is_floating_point() else v) for k, v in tensors.items()}
        save_file(tensors, out / name, metadata={"format": "pt"})
    return out


def llama_cpp_converter(llama_cpp_dir: str | Path) -> Path:
    script = Path(llama_cpp_dir) / "convert_hf_to_gguf.py"
    if not script.is_file() or not (Path(llama_cpp_dir) / "gguf-py").is_dir():
        raise HalfsafeError(f"{llama_cpp_dir} has no convert_hf_to_gguf.py and gguf-py: give a llama.cpp checkout (or "
                            "llama-cpp-python's vendor/llama.cpp), or run scripts/setup-llama-cpp")
    return script


def find_llama_cpp(llama_cpp_dir: str | Path | None = None) -> Path:
    """The llama.cpp whose converter to run: `llama_cpp_dir`, else $HALFSAFE_LLAMA_CPP_DIR, else the one
    scripts/setup-llama-cpp finished last in halfsafe's cache; none is one line naming the script."""
    given = llama_cpp_dir or os.environ.get(LLAMA_CPP_ENV)
    if not given:
        made = sorted(cache_dir().glob(f"llama-cpp-*/{SETUP_STAMP}"), key=lambda p: p.stat().st_mtime)
        if not made:
            raise HalfsafeError(f"no llama.cpp converter in {cache_dir()}: run scripts/setup-llama-cpp once (it builds the "
                                f"pinned llama-cpp-python there), or pass --llama-cpp DIR (a llama.cpp checkout)")
        given = made[-1].parent / "llama.cpp"
    llama_cpp_converter(given)
    return Path(given)


def llama_cpp_architectures(llama_cpp_dir: str | Path) -> frozenset[str] | None:
    """The Hugging Face architectures the converter knows, read as data from its own table (`TEXT_MODEL_MAP` in
    conversion/__init__.py, a literal); None where this llama.cpp has no such table (its converter still refuses)."""
    source = Path(llama_cpp_dir) / "conversion" / "__init__.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == "TEXT_MODEL_MAP" and node.value is not None:
            try:
                return frozenset(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def _converter_env(llama_cpp_dir: Path) -> dict:
    """Offline, this llama.cpp's gguf-py first, and the setup's pylib (sentencepiece) where it made this folder."""
    paths = [llama_cpp_dir / "gguf-py"]
    if (llama_cpp_dir.parent / SETUP_STAMP).is_file():
        paths.append(llama_cpp_dir.parent / "pylib")
    paths += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def convert_with_llama_cpp(folder: str | Path, out_gguf: str | Path, llama_cpp_dir: str | Path, outtype: str = "f16",
                           name: str | Path | None = None) -> Path:
    """Run llama.cpp's converter on `folder` (as is: call `prepare_for_llama_cpp` first for a halfsafe checkpoint).
    A failure is one line naming `name` (default `folder`): the converter's last line, or the architecture it does not
    know."""
    llama_cpp_dir, out_gguf = Path(os.path.abspath(llama_cpp_dir)), Path(os.path.abspath(out_gguf))
    script = llama_cpp_converter(llama_cpp_dir)
    cmd = [sys.executable, str(script), os.path.abspath(folder), "--outtype", outtype, "--outfile", str(out_gguf)]
    done = subprocess.run(cmd, env=_converter_env(llama_cpp_dir), capture_output=True, text=True, cwd=out_gguf.parent)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        unknown = [line for line in lines if line.rstrip().endswith("is not supported")]
        tail = (unknown or lines or ["?"])[-1].split(":hf-to-gguf:")[-1].strip()
        raise HalfsafeError(f"llama.cpp's convert_hf_to_gguf.py ({llama_cpp_dir}) failed on {name or folder}: {tail}")
    return Path(out_gguf)


def _rope_permuted(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The rows of a q or k projection as llama.cpp's converter lays them out for its interleaved rotary embedding
    (LlamaModel.permute: each head's two halves interleaved), values unchanged."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def compare_gguf(gguf_path: str | Path, converted: str | Path) -> dict:
    """Read the GGUF back (`gguf` package) and compare every tensor and the norm eps with the checkpoint.

    Expected values: the checkpoint's tensor; for Gemma norm gains `1.0 + w.float()` (llama.cpp stores the gain
    Gemma's RMSNorm multiplies by). Returns per-tensor results and a summary.
    """
    import gguf

    from ..io.loading import read_config

    converted = Path(converted)
    config = read_config(converted)
    text = config.get_text_config()
    shards = _shards(converted)  # the checkpoint first: a folder naming files outside it is refused before any read
    with shards:
        hf = {k: shards.load(k) for k in shards.keys()}
    reader = gguf.GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    eps_field = reader.fields.get(f"{arch}.attention.layer_norm_rms_epsilon")
    eps_gguf = float(eps_field.parts[-1][0]) if eps_field is not None else None
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, text.num_hidden_layers)
    stored = {t.name: t for t in reader.tensors}
    gain1p = family_for(config.model_type).one_plus_norm_gains  # llama.cpp stores 1 + w for these norms
    heads = {"q_proj": text.num_attention_heads, "k_proj": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}
    rows = []
    for name, w in hf.items():
        base = name.removesuffix(".weight").removesuffix(".bias")
        suffix = name[len(base):]
        gname = name_map.get_name(base.removeprefix("model.") if base.startswith("model.") else base)
        gname = gname or name_map.get_name(base)
        if gname is None or gname + suffix not in stored:
            rows.append({"tensor": name, "gguf": None, "exact": None})
            continue
        t = stored[gname + suffix]
        got = torch.from_numpy(np.array(t.data)).float().reshape(-1)
        want = w.float()
        if gain1p and name.endswith("norm.weight"):
            want = 1.0 + want
        layouts = {"as is": want}
        proj = base.rsplit(".", 1)[-1]
        if proj in heads and want.shape[0] % (2 * heads[proj]) == 0:  # llama.cpp's rotary layout for some archs
            layouts["rope-permuted"] = _rope_permuted(want, heads[proj])
        if "embed_tokens" in name:  # llama.cpp drops Gemma's unused vocabulary rows: the rows it keeps, compared
            layouts = {k: v.reshape(-1)[: got.numel()] for k, v in layouts.items()}
        layout = next((k for k, v in layouts.items() if v.numel() == got.numel() and torch.equal(got, v.reshape(-1))), None)
        value = layouts[layout or "as is"].reshape(-1)
        diff = float((got - value).abs().max()) if got.numel() == value.numel() else float("inf")
        rows.append({"tensor": name, "gguf": gname + suffix, "dtype": t.tensor_type.name, "layout": layout,
                     "exact": layout is not None, "max_abs_diff": diff})
    found = [r for r in rows if r["exact"] is not None]
    norms = [r for r in found if r["tensor"].endswith("norm.weight")]
    checked = {r["gguf"] for r in found}
    return {
        "arch": arch,
        "gguf_unchecked": sorted(n for n in stored if n not in checked),  # tensors llama.cpp made (none from the checkpoint)
        "eps_config": text.rms_norm_eps if hasattr(text, "rms_norm_eps") else None,
        "eps_gguf": eps_gguf,
        "eps_exact": bool(eps_gguf is not None and np.float32(eps_gguf) == np.float32(text.rms_norm_eps)),
        "tensors_compared": len(found),
        "tensors_not_found": [r["tensor"] for r in rows if r["exact"] is None],
        "exact": sum(r["exact"] for r in found),
        "norm_gains": len(norms),
        "norm_gains_exact": sum(r["exact"] for r in norms),
        "norm_gain_max_abs_diff": max((r["max_abs_diff"] for r in norms), default=0.0),
        "max_abs_diff": max((r["max_abs_diff"] for r in found), default=0.0),
        "rows": rows,
    }


# What llama.cpp (this release's src/models/<arch>.cpp) computes without reading it from config.json. The GGUF holds
# `{arch}.attention.sliding_window` (the window) and may hold `sliding_window_pattern` (one flag per block, or a
# period); without a pattern gemma2 and gemma3 take a period of their own (the last block of each period global, the
# rest sliding), gemma2 a window of 4096 without one, and every other architecture here attends fully in every block
# (qwen2, qwen3, llama read no window; phi3 reads one and switches it off). The attention scale of Gemma 2 and 3 is
# not in the GGUF: 1/sqrt(head_dim), or 1/sqrt(hidden/heads) at the 27B depth, where transformers uses
# query_pre_attn_scalar.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_SWA_DEFAULT = {"gemma2": 4096}  # a window without one in the GGUF
_SCALE_27B_DEPTH = {"gemma2": 46, "gemma3": 62}  # the depth at which the scale is 1/sqrt(hidden/heads)
_ARCH_OF = {"gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3"}  # model_type -> llama.cpp's


def _gguf_windows(arch: str, n_layer: int, window: int | None, pattern) -> list[int | None]:
    """Each block's sliding window as llama.cpp's loader sets it from the GGUF's window and pattern (None: full)."""
    if arch not in _SWA_PERIOD:
        return [None] * n_layer
    window = _SWA_DEFAULT.get(arch) if window is None else window
    if not window:
        return [None] * n_layer
    if isinstance(pattern, list):
        flags = [bool(f) for f in pattern][:n_layer]
    else:
        period = _SWA_PERIOD[arch] if pattern is None else int(pattern)
        flags = [period == 0 or i % period < period - 1 for i in range(n_layer)]
    return [window if f else None for f in flags]


def _config_windows(text) -> list[int | None]:
    """Each block's sliding window as transformers computes it (layer_types, else the one window every block uses);
    a window no shorter than max_position_embeddings never binds, so it is full attention."""
    n, window = text.num_hidden_layers, getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    windows = [window if t == "sliding_attention" else None for t in types] if types else [window] * n
    longest = getattr(text, "max_position_embeddings", None)
    return [None if w is None or (longest and w >= longest) else int(w) for w in windows]


def _blocks(windows: list[int | None]) -> str:
    kinds = ["full" if w is None else f"window {w}" for w in windows]
    return "[" + ", ".join(kinds) + "]"


def llama_cpp_differences(config, gguf: dict | None = None) -> list[str]:
    """What llama.cpp would compute otherwise than transformers does with `config`: per-block attention (sliding
    window or full), the attention scale, bidirectional attention; each in words, empty where none. `gguf`: the
    GGUF's arch, window and pattern as read back (gguf_attention); without it (before the converter runs) as the
    converter's set_gguf_parameters writes them."""
    text = config.get_text_config()
    if gguf is not None:
        arch, window, pattern = gguf["arch"], gguf["window"], gguf["pattern"]
    else:
        arch = _ARCH_OF.get(text.model_type) or _ARCH_OF.get(config.model_type) or text.model_type
        pattern = None  # no converter of these architectures writes one
        window = None if arch == "gemma3" and getattr(text, "sliding_window_pattern", None) == 1 else getattr(text, "sliding_window", None)
    n = text.num_hidden_layers
    ours, theirs = _config_windows(text), _gguf_windows(arch, n, window, pattern)
    longest = getattr(text, "max_position_embeddings", None)
    theirs = [None if w is None or (longest and w >= longest) else w for w in theirs]
    found = []
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        found.append(f"attention per block {_blocks(ours)} where llama.cpp's {arch} assumes {_blocks(theirs)} "
                     f"(block {first} first)")
    scalar = getattr(text, "query_pre_attn_scalar", None)
    if arch in _SCALE_27B_DEPTH and scalar is not None:
        width = text.hidden_size / text.num_attention_heads if n == _SCALE_27B_DEPTH[arch] else text.head_dim
        if np.float32(1 / np.sqrt(float(width))) != np.float32(float(scalar) ** -0.5):
            found.append(f"query_pre_attn_scalar {scalar} where llama.cpp's {arch} scales attention by 1/sqrt({width:g})")
    if getattr(text, "use_bidirectional_attention", False):
        found.append(f"bidirectional attention where llama.cpp's {arch} is causal")
    return found


def check_llama_cpp_assumptions(config, folder, gguf: dict | None = None) -> None:
    found = llama_cpp_differences(config, gguf)
    if found:
        raise HalfsafeError(f"{folder}: config.json has {'; '.join(found)}: llama.cpp would compute another function, so "
                            "no GGUF for it; use another runtime (export onnx, vLLM, transformers)")


def gguf_attention(gguf_path: str | Path) -> dict:
    """The GGUF's architecture, sliding window and pattern as llama.cpp's loader reads them (None where absent)."""
    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields
    arch = fields["general.architecture"].contents()
    window, pattern = (fields.get(f"{arch}.attention.{k}") for k in ("sliding_window", "sliding_window_pattern"))
    return {"arch": arch, "window": None if window is None else int(window.contents()),
            "pattern": None if pattern is None else pattern.contents()}


@dataclass
class GgufExportReport:
    path: str
    arch: str  # llama.cpp's name for the architecture
    model_type: str
    llama_cpp: str  # the folder whose converter wrote it
    file_bytes: int
    tensors: int  # stored and compared, every one exact
    not_stored: list[str] = field(default_factory=list)  # checkpoint tensors llama.cpp leaves out (a vision tower)

    def to_dict(self) -> dict:
        return asdict(self)


def check_gguf_source(folder: str | Path, llama_cpp_dir: Path) -> str:
    """A folder `halfsafe convert` wrote (halfsafe.json), whose architecture llama.cpp's converter knows; its
    model_type. Refused in one line before anything is copied."""
    from ..io.loading import read_config

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise HalfsafeError(f"{folder} is not a folder: give the folder `halfsafe convert` wrote (config.json + *.safetensors)")
    config = read_config(folder)  # the trust checks first: every file inside the folder, no code of its own
    if not (folder / "halfsafe.json").is_file():
        raise HalfsafeError(f"{folder} has no halfsafe.json: it was not converted by halfsafe, and an F16 GGUF of it may "
                            f"overflow; run `halfsafe convert {folder} OUT` and export OUT")
    known = llama_cpp_architectures(llama_cpp_dir)
    raw = json.loads((folder / "config.json").read_text())
    archs = [a for part in (raw, raw.get("text_config") or {}) if isinstance(part, dict)
             for a in (part.get("architectures") or [])[:1] if isinstance(a, str)]
    if known is not None and not any(a in known for a in archs):
        raise HalfsafeError(f"{folder}: llama.cpp's converter ({llama_cpp_dir}) does not know model_type "
                            f"{config.model_type!r} ({', '.join(archs) or 'no architectures in config.json'}): "
                            "no GGUF for it; use another runtime (export onnx, vLLM, transformers)")
    check_llama_cpp_assumptions(config, folder)  # as data, before the converter runs
    return config.model_type


def check_gguf_out(out: str | Path, overwrite: bool, inputs=()) -> Path:
    """OUT.gguf, before the slow part: a file outside every input (halfsafe.io.paths.check_report_path), absent
    unless `overwrite`, and then a GGUF file (its magic), never something else it would replace."""
    from ..io.paths import check_report_path

    out = check_report_path(out, "OUT", inputs)
    if os.path.lexists(out):
        if not overwrite:
            raise HalfsafeError(f"{out} already exists: choose another output file or pass --overwrite")
        magic = b""
        if out.is_file():  # never opened otherwise: a FIFO would block the read
            try:
                with open(out, "rb") as f:
                    magic = f.read(len(GGUF_MAGIC))
            except OSError as e:
                raise HalfsafeError(f"{out} cannot be read ({e.strerror}): choose another output file") from None
        if magic != GGUF_MAGIC:
            raise HalfsafeError(f"{out} exists and is not a GGUF file: --overwrite replaces a GGUF file only; choose "
                                "another output file")
    return out


def export_gguf(folder: str | Path, out: str | Path, llama_cpp_dir: str | Path | None = None,
                overwrite: bool = False) -> GgufExportReport:
    """`halfsafe export gguf FOLDER OUT`: an F16 GGUF of the checkpoint `halfsafe convert` wrote, by llama.cpp's own
    converter on `prepare_for_llama_cpp`'s copy (in a temporary folder beside OUT, never in FOLDER), then read back:
    OUT is written (one rename) only if every tensor llama.cpp stored is one of the checkpoint's, exact, and the norm
    eps is the config's; otherwise nothing is left behind and the first tensor that differs is named."""
    llama_cpp = find_llama_cpp(llama_cpp_dir)
    folder = Path(folder).expanduser()
    model_type = check_gguf_source(folder, llama_cpp)
    out = check_gguf_out(out, overwrite, inputs=[folder])
    return _write_gguf(folder, out, llama_cpp, model_type)


def check_gguf_target(source: str | Path, llama_cpp_dir: str | Path | None = None) -> Path:
    """Before `convert --to gguf` spends its time converting: the llama.cpp to run, and a local model whose
    architecture its converter does not know refused (checked again on the converted folder)."""
    from ..io.loading import read_config
    from ..io.trust import check_folder

    llama_cpp = find_llama_cpp(llama_cpp_dir)
    config = Path(source).expanduser() / "config.json"
    known = llama_cpp_architectures(llama_cpp)
    if known is not None and config.is_file():
        check_folder(config.parent)  # first: a config.json linking outside the folder is refused, never read
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            return llama_cpp  # the conversion reports an unreadable config in its own words
        archs = [a for part in (raw, raw.get("text_config") if isinstance(raw, dict) else None) if isinstance(part, dict)
                 for a in (part.get("architectures") or [])[:1] if isinstance(a, str)]
        if archs and not any(a in known for a in archs):
            raise HalfsafeError(f"{source}: llama.cpp's converter ({llama_cpp}) does not know {', '.join(archs)} "
                                f"(model_type {raw.get('model_type')!r}): no GGUF for it; convert without --to gguf")
        try:
            parsed = read_config(config.parent)
        except HalfsafeError:
            return llama_cpp  # the conversion reports it in its own words
        check_llama_cpp_assumptions(parsed, source)  # the conversion keeps the attention layout: refused now, not after
    return llama_cpp


GGUF_FILE = "model-f16.gguf"  # convert --to gguf: the GGUF beside the checkpoint's weights


def add_gguf(folder: str | Path, llama_cpp: Path, final: str | Path | None = None) -> GgufExportReport:
    """`halfsafe convert --to gguf`: the F16 GGUF written into the converted checkpoint's temporary folder (at `final`
    once complete) as GGUF_FILE, checked as `export_gguf` checks it, and the folder sealed (halfsafe.json lists it)."""
    from ..io.report import seal

    folder = Path(folder)
    report = _write_gguf(folder, folder / GGUF_FILE, llama_cpp, check_gguf_source(folder, llama_cpp))
    seal(folder)
    report.path = str(Path(final) / GGUF_FILE) if final is not None else report.path
    return report


def _write_gguf(folder: Path, out: Path, llama_cpp: Path, model_type: str) -> GgufExportReport:
    """prepare_for_llama_cpp's copy and llama.cpp's converter in temporary names beside `out`; the GGUF read back and
    renamed to `out` only if every stored tensor is the checkpoint's own, exact."""
    from ..io.loading import read_config
    from ..io.paths import write_file

    result: dict = {}

    def write(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".halfsafe-gguf-", dir=tmp.parent) as work:
            prepared = prepare_for_llama_cpp(folder, Path(work) / "prepared")
            convert_with_llama_cpp(prepared, tmp, llama_cpp, name=folder)
        result.update(compare_gguf(tmp, folder))
        check_llama_cpp_assumptions(read_config(folder), folder, gguf_attention(tmp))  # again, as the GGUF records it
        wrong = [r for r in result["rows"] if r["exact"] is False]
        if wrong or not result["tensors_compared"]:
            first = wrong[0] if wrong else None
            raise HalfsafeError(f"llama.cpp's GGUF of {folder} is not exact" + (
                f" ({len(wrong)} tensors differ, first {first['tensor']} as {first['gguf']} by up to {first['max_abs_diff']:.3g})"
                if first else " (halfsafe found none of the checkpoint's tensors in it)") + ": nothing was written")
        if result["gguf_unchecked"]:  # stacked experts, a table llama.cpp computed: nothing vouches for them
            unchecked = result["gguf_unchecked"]
            raise HalfsafeError(f"llama.cpp's GGUF of {folder} holds {len(unchecked)} tensors halfsafe cannot compare with the "
                                f"checkpoint (first {unchecked[0]}): nothing was written")
        if result["eps_gguf"] is not None and result["eps_config"] is not None and not result["eps_exact"]:
            raise HalfsafeError(f"llama.cpp's GGUF of {folder} holds norm eps {result['eps_gguf']:.6g}, config.json "
                                f"{result['eps_config']:.6g}: nothing was written")

    write_file(out, write, "OUT")
    return GgufExportReport(path=str(out), arch=result["arch"], model_type=model_type, llama_cpp=str(llama_cpp),
                            file_bytes=out.stat().st_size, tensors=result["tensors_compared"],
                            not_stored=result["tensors_not_found"])
