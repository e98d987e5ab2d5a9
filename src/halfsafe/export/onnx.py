"""fp16 ONNX of a converted checkpoint, for ONNX Runtime and transformers.js: no Clip nodes, no fp32 islands added.

The exporter is transformers' own `transformers.exporters.OnnxExporter` (torch.export, then torch.onnx's dynamo
exporter and onnxscript's optimizer), run on the model loaded all-fp16, so the graph computes exactly what
PyTorch computes in fp16: fp16 weights and activations, and the fp32 casts the modeling code itself makes
(Gemma's RMSNorm). optimum's ONNX exporter (optimum-onnx 0.1) needs transformers < 4.58, so it is not used.

halfsafe's glue: sample inputs with a KV cache and dynamic batch / sequence / past axes; graph inputs and
outputs renamed to the names ONNX Runtime GenAI-style and transformers.js decoders use
(`input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.key|value` -> `logits`, `present.{i}.key|value`);
the file layout of a transformers.js model (config, generation config, tokenizer, `onnx/model_fp16.onnx`);
checks (no Clip nodes, fp16 weights); and small runners for ONNX Runtime and onnx's reference evaluator
(which, unlike ONNX Runtime's CPU provider, computes fp16 ops in fp16).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import HalfsafeError, UnsupportedModelError
from ..io.card import TITLE as _CONVERSION_TITLE  # the model card's conversion section

log = logging.getLogger(__name__)

EXPORTER = "transformers' OnnxExporter (torch.onnx dynamo)"
ONNX_FILE = "onnx/model_fp16.onnx"
EXTERNAL_DATA_SUFFIX = "_data"  # transformers.js names a model's external weights `<file>.onnx_data`
INLINE_LIMIT = 1_800_000_000  # protobuf holds at most 2 GiB: larger weights go to the external data file
_SKIP = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.gguf")
_CACHE_NAME = re.compile(r"^(?:input\.|output\.)?(?:cache|past_key_values)\.layers\.(\d+)\.(keys|values)$")


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
    split_k: dict = field(default_factory=dict)  # --runtime P with split_k: groups asked and products split per kind

    def to_dict(self) -> dict:
        return asdict(self)


def require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnx_ir  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise HalfsafeError(f"the ONNX export needs {e.name}: pip install 'halfsafe[onnx]'") from None


def versions() -> dict[str, str]:
    import onnx
    import onnxscript
    import transformers

    out = {"transformers": transformers.__version__, "torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__}
    try:
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return out


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------


def check_source(source: str | Path) -> Path:
    folder = Path(source).expanduser()
    if not folder.exists():
        raise HalfsafeError(f"{source} does not exist: give the folder `halfsafe convert` wrote")
    if not folder.is_dir():
        raise HalfsafeError(f"{source} is not a folder: give the folder `halfsafe convert` wrote (config.json + *.safetensors)")
    return folder


def check_exportable(config) -> None:
    """Only decoder-only text generation (a causal LM with a KV cache) is exported."""
    from transformers import AutoModelForCausalLM

    from ..io.loading import model_class_for

    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{model_type} is an encoder-decoder model: the ONNX export ({EXPORTER}) here covers decoder-only text generation only"
        )
    cls = model_class_for(config)
    if cls not in AutoModelForCausalLM._model_mapping.values():
        raise UnsupportedModelError(
            f"{model_type} ({cls.__name__}) is not a causal LM: the ONNX export ({EXPORTER}) here covers decoder-only text generation only"
        )


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


# ----------------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------------


def load_exportable_fp16(folder: Path, check, model_class=None):
    """The checkpoint in `folder`, all-fp16 (no module kept in fp32), eval mode, once `check(config)` accepts it:
    the one loader of the three exports. `model_class` None: the class the config names."""
    from ..io.loading import model_class_for, read_config
    from ..io.trust import quiet_transformers
    from ..runtime.fp16 import load_pure_fp16

    config = read_config(folder)
    check(config)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise HalfsafeError(f"{folder} has a config.json but no weights (*.safetensors): copy the weight files next to it")
    with quiet_transformers():
        model = load_pure_fp16(model_class or model_class_for(config), folder, local_files_only=True)
    return model.eval()


def load_fp16(folder: Path):
    """The checkpoint in `folder` as an all-fp16 causal LM (no module kept in fp32), eval mode."""
    from transformers import AutoModelForCausalLM

    return load_exportable_fp16(folder, check_exportable, AutoModelForCausalLM)


def _kv_shape(config) -> tuple[int, int, int]:
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def sample_inputs(model, batch: int = 2, past: int = 3, new: int = 2) -> tuple[dict, dict]:
    """Forward kwargs for one decode step with a KV cache, and their dynamic axes.

    The cache holds every position for every layer (a plain DynamicCache, no per-layer sliding window): sliding
    layers are masked by position, so present = past + new for all layers, as transformers.js expects.
    """
    from torch.export import Dim
    from transformers import DynamicCache

    layers, kv_heads, head_dim = _kv_shape(model.config)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    for i in range(layers):
        k = torch.randn(batch, kv_heads, past, head_dim, generator=g).to(dtype)
        v = torch.randn(batch, kv_heads, past, head_dim, generator=g).to(dtype)
        cache.update(k, v, i)
    vocab = model.config.get_text_config().vocab_size
    inputs = {
        "input_ids": torch.randint(0, vocab, (batch, new), generator=g),
        "attention_mask": torch.ones(batch, past + new, dtype=torch.long),
        "position_ids": torch.arange(past, past + new).expand(batch, new).contiguous(),
        "cache": cache,
        "use_cache": True,
    }
    # Dim.AUTO on the axes that vary: torch.export infers that the mask spans past + new itself.
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    shapes = {"input_ids": auto, "attention_mask": auto, "position_ids": auto, "cache": [{0: Dim.AUTO, 2: Dim.AUTO}] * (2 * layers)}
    return inputs, shapes


def _rename_io(graph) -> None:
    for value in list(graph.inputs) + list(graph.outputs):
        m = _CACHE_NAME.match(value.name)
        if m:
            kind = "key" if m.group(2) == "keys" else "value"
            prefix = "present" if value in graph.outputs else "past_key_values"
            value.name = f"{prefix}.{m.group(1)}.{kind}"
    names = [v.name for v in graph.inputs] + [v.name for v in graph.outputs]
    expected = re.compile(r"^(input_ids|attention_mask|position_ids|logits|(past_key_values|present)\.\d+\.(key|value))$")
    odd = [n for n in names if not expected.match(n)]
    if odd:
        raise HalfsafeError(f"unexpected graph inputs/outputs from {EXPORTER}: {odd[:4]} (please report this)")


# The free dimensions as the onnx-community exports name them: transformers.js 4.x builds the empty KV cache from
# the session's input shapes, `batch_size` resolved to the batch and every other name to 0.
_DIM_NAMES = {
    "input_ids": ("batch_size", "sequence_length"),
    "attention_mask": ("batch_size", "total_sequence_length"),
    "position_ids": ("batch_size", "sequence_length"),
    "past_key_values": ("batch_size", None, "past_sequence_length", None),
    "logits": ("batch_size", "sequence_length", None),
    "present": ("batch_size", None, "total_sequence_length", None),
}
_SYMBOL = re.compile(r"\bs\d+\b")  # torch.export's symbols: s10, s54 + s70, ...


def _name_dims(graph, table: dict = _DIM_NAMES) -> None:
    """Name the graph inputs' and outputs' free dimensions (`table`: by full name, else by the name's first part),
    and the same symbols in the values inside."""
    import onnx_ir as ir

    symbols: dict[str, str] = {}
    for value in list(graph.inputs) + list(graph.outputs):
        names = table.get(value.name) or table[value.name.split(".")[0]]
        dims = list(value.shape)
        for i, name in enumerate(names):
            if name is not None and not isinstance(dims[i], int):
                if dims[i].value is not None and _SYMBOL.fullmatch(dims[i].value):
                    symbols.setdefault(dims[i].value, name)
                dims[i] = ir.SymbolicDim(name)
        value.shape = ir.Shape(dims)
    io = set(graph.inputs) | set(graph.outputs)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.outputs:
            if value.shape is None or value in io:
                continue
            dims = [d if isinstance(d, int) or d.value is None else ir.SymbolicDim(_SYMBOL.sub(lambda m: symbols.get(m.group(0), m.group(0)), d.value))
                    for d in value.shape]
            value.shape = ir.Shape(dims)


def _float32_logits(graph, name: str = "logits") -> None:
    """A Cast of the fp16 output `name` to float32 as the graph's `name` (the fp16 graph is unchanged): transformers.js
    3.x in Node (no Float16Array) reads fp16 logits as their raw bits."""
    import onnx_ir as ir

    index = next(i for i, v in enumerate(graph.outputs) if v.name == name)
    fp16 = graph.outputs[index]
    fp16.name = f"{name}_fp16"
    out = ir.Value(name=name, shape=fp16.shape, type=ir.TensorType(ir.DataType.FLOAT))
    graph.append(ir.node("Cast", [fp16], {"to": ir.DataType.FLOAT}, outputs=[out], name=f"halfsafe_{name}_float32"))
    graph.outputs[index] = out


def run_exporter(module, inputs: dict, shapes: dict, what: str, context=None):
    """transformers' OnnxExporter on `module` (inside `context`, if given): its `onnx_ir` program, or a one-line
    UnsupportedModelError naming `what` failed to export. The one call of the exporter for every export."""
    from contextlib import nullcontext

    from transformers.exporters import OnnxConfig, OnnxExporter

    from ..io.loading import _first_line
    from ..io.trust import quiet_transformers

    config = OnnxConfig(dynamic_shapes=shapes, prefer_deferred_runtime_asserts_over_guards=True)
    try:
        with quiet_transformers(), torch.no_grad(), context or nullcontext():
            return OnnxExporter().export(module, inputs, config).program
    except HalfsafeError:
        raise
    except Exception as e:  # the exporter fails in many ways on an architecture it cannot trace
        raise UnsupportedModelError(f"{EXPORTER} could not export {what} ({type(e).__name__}: {_first_line(e)})") from None


def export_program(model):
    """The fp16 ONNX graph (an `onnx_ir.Model`) of a causal LM, with a KV cache and transformers.js I/O names."""
    require_onnx()
    inputs, shapes = sample_inputs(model)
    program = run_exporter(model, inputs, shapes, model.config.model_type)
    _rename_io(program.graph)
    _name_dims(program.graph)
    _float32_logits(program.graph)
    return program


def save_program(program, path: Path) -> None:
    """Save inline when the weights fit in one protobuf, else beside it as `<file>_data` (transformers.js's name)."""
    import onnx_ir

    path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(v.const_value.nbytes for v in program.graph.initializers.values() if v.const_value is not None)
    if weight_bytes < INLINE_LIMIT:
        onnx_ir.save(program, str(path))
    else:
        onnx_ir.save(program, str(path), external_data=path.name + EXTERNAL_DATA_SUFFIX)


def inspect_file(path: Path) -> dict:
    """Clip nodes, initializer dtypes and sizes of a saved ONNX file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dtypes: dict[str, int] = {}
    fp16_bytes = 0
    for init in model.graph.initializer:
        name = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).name
        dtypes[name] = dtypes.get(name, 0) + 1
        if init.data_type == onnx.TensorProto.FLOAT16:
            n = int(np.prod(init.dims)) if init.dims else 1
            fp16_bytes += 2 * n
    ext = path.with_name(path.name + EXTERNAL_DATA_SUFFIX)
    return {
        "inputs": [i.name for i in model.graph.input],
        "outputs": [o.name for o in model.graph.output],
        "clip_nodes": sum(n.op_type == "Clip" for n in model.graph.node),
        "initializer_dtypes": dtypes,
        "fp16_weight_bytes": fp16_bytes,
        "file_bytes": path.stat().st_size + (ext.stat().st_size if ext.exists() else 0),
        "external_data": ext.exists(),
    }


def _copy_side_files(src: Path, dst: Path) -> None:
    """Config, generation config, tokenizer, halfsafe.json, card and legal text: everything but the weights."""
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in _SKIP):
            shutil.copy2(f, dst / f.name)


def _mark_config(folder: Path, external: bool | list[str], kv_cache: bool = True) -> None:
    """transformers.js reads its loading options from config.json: fp16 weights, an fp16 KV cache (3.x makes the
    empty cache in the dtype it names, float32 if none; `kv_cache`: the model has one), and which files keep their
    weights in an external data file (`external`: the .onnx file names, or True for `model_fp16.onnx`)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    js = {"dtype": "fp16", "kv_cache_dtype": {"fp16": "float16"}} if kv_cache else {"dtype": "fp16"}
    if external:
        js["use_external_data_format"] = {name: True for name in (external if isinstance(external, list) else [Path(ONNX_FILE).name])}
    config["transformers.js_config"] = js
    path.write_text(json.dumps(config, indent=2) + "\n")


def _mark_tokenizer(folder: Path) -> None:
    """transformers.js's text-generation pipeline adds special tokens only when tokenizer_config.json says
    `add_bos_token` or `add_eos_token`; transformers adds what the tokenizer's post-processor adds (Gemma's <bos>).
    Write the flags the tokenizer's own behaviour implies, so the client encodes a prompt as transformers does."""
    path = folder / "tokenizer_config.json"
    if not path.is_file() or not (folder / "tokenizer.json").is_file():
        return
    from transformers import AutoTokenizer

    from ..io.loading import _first_line
    from ..io.trust import from_pretrained, quiet_transformers

    try:
        with quiet_transformers():
            tokenizer = from_pretrained(AutoTokenizer, folder, local_files_only=True)
    except Exception as e:  # a tokenizer transformers cannot load: nothing to match
        log.warning(f"tokenizer in {folder} not loaded ({type(e).__name__}: {_first_line(e)}): add_bos_token not written")
        return
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("Hello")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = json.loads(path.read_text())
    config["add_bos_token"] = bos is not None and full[:1] == [bos] and plain[:1] != [bos]
    config["add_eos_token"] = eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]
    path.write_text(json.dumps(config, indent=2) + "\n")


_CARD_TITLE = "## fp16 ONNX (halfsafe export onnx)"


# per task: the example call on the card, and what the graph takes and gives (for ONNX Runtime users)
_CARD_CALLS = {
    "text-generation": "const out = await pipe('The quick brown fox', { max_new_tokens: 32, do_sample: false });",
    "text2text-generation": "const out = await pipe('translate English to German: Hello', { max_new_tokens: 32, do_sample: false });",
    "feature-extraction": "const out = await pipe('The quick brown fox', { pooling: 'none' });  // last_hidden_state",
    "fill-mask": "const out = await pipe('The quick brown {mask} jumps over the lazy dog.');",
}
_CARD_IO = {
    "text-generation": "`input_ids`, `attention_mask`, `position_ids` (int64) and an fp16 KV cache `past_key_values.{i}.key|value` "
                       "[batch, kv_heads, past, head_dim] (empty at the start) -> `logits`, `present.{i}.key|value`.",
    "text2text-generation": "the encoder (`input_ids`, `attention_mask` -> `last_hidden_state`), then the decoder (`input_ids`, "
                            "`encoder_attention_mask`, `encoder_hidden_states`, fp16 `past_key_values.{i}.decoder.key|value`, "
                            "empty at the start -> `logits`, `present.{i}.decoder|encoder.key|value`).",
    "feature-extraction": "`input_ids`, `attention_mask` (and `token_type_ids` where the model has token types; int64) -> "
                          "`last_hidden_state` (float32).",
    "fill-mask": "`input_ids`, `attention_mask` (and `token_type_ids` where the model has token types; int64) -> `logits` "
                 "(float32).",
}


def write_card(folder: Path, files: list[str], task: str = "text-generation", no_js_class: str | None = None,
               name: str | None = None) -> None:
    """The model card's ONNX section: what the files are and how transformers.js and ONNX Runtime load them
    (`no_js_class`: the model type transformers.js has no class for, then ONNX Runtime only). In a folder without
    PyTorch weights the conversion section (which says to load them with transformers) is cut down. `name`: the
    folder's name once in place (default: `folder`'s own; a temporary folder's name is not the model's)."""
    path = folder / "README.md"
    text = path.read_text() if path.is_file() else ""
    torch_weights = any(folder.glob("*.safetensors"))
    if not torch_weights and _CONVERSION_TITLE in text:
        text = text[: text.index(_CONVERSION_TITLE)].rstrip() + "\n"
    if _CARD_TITLE in text:
        text = text[: text.index(_CARD_TITLE)].rstrip() + "\n"
    name = name or folder.name
    converted = (folder / "halfsafe.json").is_file()
    sizes = ", ".join(f"`{f}` ({sum(p.stat().st_size for p in folder.glob(f + '*')) / 2**20:,.0f} MiB)" for f in files)
    generates = task in ("text-generation", "text2text-generation")
    output = "logits" if task != "feature-extraction" else "last_hidden_state"
    mask = _tokenizer_field(folder, "mask_token") or "[MASK]"
    n_clip = sum(inspect_file(folder / f)["clip_nodes"] for f in files)
    clips = f"{n_clip} Clip nodes, the modeling code's own fp16 clamp (none added)" if n_clip else "no Clip nodes"
    lines = [
        "", _CARD_TITLE, "",
        ("Converted by halfsafe (an exact power-of-two rescaling; `halfsafe.json` lists every rescaled tensor), then "
         if converted else "Not converted by halfsafe (no `halfsafe.json`): its fp16 activations may overflow. ")
        + f"exported to float16 ONNX: {sizes}. fp16 weights{', fp16 KV cache' if generates else ''}, {clips}; "
        f"float32 {output} (a Cast at the end of the graph). " + ("" if torch_weights else "There are no PyTorch weights here: load it with "
                                                                 "transformers.js or ONNX Runtime, not transformers."),
    ]
    if no_js_class:
        lines += ["", f"transformers.js (3.8.1, 4.3.2) has no model class for {no_js_class}: run it with ONNX Runtime."]
    else:
        lines += [
            "",
            "transformers.js (Node or a browser; tested with 3.8.1 and 4.3.2 in Node 20"
            + (", and on the WASM backend in Chromium" if task == "text-generation" else "") + "):",
            "",
            "```js",
            "import { env, pipeline } from '@huggingface/transformers';",
            "env.allowRemoteModels = false;",
            f"env.localModelPath = '/path/to/the/folder/above/{name}/';",
            f"const pipe = await pipeline('{task}', '{name}');  // fp16 from config.json",
            _CARD_CALLS[task].replace("{mask}", mask),
            "```",
            "",
            "Where npm cannot reach onnxruntime-node's download host, `npm install @huggingface/transformers --ignore-scripts`",
            "installs it all the same (the CPU binaries are in the npm package).",
        ]
    lines += ["", "ONNX Runtime: " + _CARD_IO[task]]
    path.write_text(text.rstrip() + "\n" + "\n".join(lines) + "\n")


def _tokenizer_field(folder: Path, key: str):
    path = folder / "tokenizer_config.json"
    try:
        value = json.loads(path.read_text()).get(key) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return value.get("content") if isinstance(value, dict) else value


# The exporter modules (this one for decoders, onnx_seq2seq, onnx_encoder) each give: load_fp16(folder) -> model,
# programs(model) -> (file, graph) pairs one at a time, and finish(folder, name): config, tokenizer and card for the
# files (`name`: the folder's name once in place, for the card).

def programs(model):
    yield ONNX_FILE, export_program(model)


def finish(folder: Path, name: str | None = None) -> None:
    if (folder / "config.json").is_file():
        _mark_config(folder, (folder / (ONNX_FILE + EXTERNAL_DATA_SUFFIX)).exists())
    _mark_tokenizer(folder)
    write_card(folder, [ONNX_FILE], name=name)


def write_onnx(model, folder: Path, source: Path | None = None, exporter=None, name: str | None = None,
               profile=None, split: dict | None = None) -> Path:
    """Export `model` (all-fp16) into `folder/onnx/` with `exporter` (default: this module, decoders); copy
    `source`'s side files if given; `name`: the folder's name once in place (the card's); `profile`: its split-K
    rewrite made on each graph (counted into `split`). Returns the last file written (the decoder of an
    encoder-decoder)."""
    import sys

    exporter = exporter or sys.modules[__name__]
    for rel, program in exporter.programs(model):  # one graph in memory at a time
        path = folder / rel
        split_graph(profile, program, split)
        save_program(program, path)
        del program
    if source is not None:
        _copy_side_files(source, folder)
    exporter.finish(folder, name)
    return path


def exporter_for(folder: Path):
    """The module that exports `folder`'s model: this one (decoder-only), `onnx_seq2seq` (encoder-decoder) or
    `onnx_encoder` (BERT-style encoders)."""
    import sys

    from ..io.loading import read_config
    from . import onnx_encoder, onnx_seq2seq

    config = read_config(folder)
    if onnx_seq2seq.is_seq2seq(config):
        return onnx_seq2seq
    if onnx_encoder.is_encoder(config):
        return onnx_encoder
    return sys.modules[__name__]


def check_folder_exportable(folder: str | Path) -> None:
    """Refuse, before `convert --to onnx` spends its time converting, a local model the export does not cover."""
    from ..io.loading import read_config

    folder = Path(folder).expanduser()
    if (folder / "config.json").is_file():
        exporter_for(folder).check_exportable(read_config(folder))


def export_onnx(source: str | Path, out: str | Path, overwrite: bool = False, scan: bool = False,
                runtime: str | None = None) -> OnnxExportReport:
    """`halfsafe export onnx SOURCE OUT`: the checkpoint `halfsafe convert` wrote, as an fp16 ONNX model folder.
    `runtime`: a profile that computes norm statistics in float16 gets its norms prescaled (halfsafe.export.onnx_norms)."""
    from ..io.checkpoint import atomic_folder, check_out_dir
    from ..io.report import seal
    from ..runtime.profiles import get_profile

    profile = get_profile(runtime)
    folder = check_source(source)
    out = check_out_dir(out, overwrite, inputs=[folder])
    require_onnx()
    warning = not_converted_warning(folder)
    if warning and scan:
        warning += "; " + scan_summary(folder)
    if warning:
        log.warning(warning)  # before the slow part
    exporter = exporter_for(folder)
    model = exporter.load_fp16(folder)
    prescales, groups = rewrite_for(profile, model, folder)
    split = {}
    try:
        with atomic_folder(out, replace=overwrite) as tmp:
            path = out / write_onnx(model, tmp, source=folder, exporter=exporter, name=out.name, profile=profile,
                                    split=split).relative_to(tmp)
            seal(tmp)  # the source's halfsafe.json now lists this folder's files (--overwrite checks them)
    except OSError as e:
        raise HalfsafeError(f"could not write {out} ({e.strerror or e}): nothing was left behind; free some space or "
                            "choose another output folder") from None
    report = report_for(path, model.config.model_type, converted=warning is None, warning=warning)
    report.runtime, report.norm_prescales, report.head_groups, report.split_k = profile.name, prescales, groups, split
    return report


def split_graph(profile, program, counts: dict | None = None) -> None:
    """`profile`'s split-K rewrite (halfsafe.export.onnx_split_k) on an exported graph, in place; the products split
    per kind added to `counts`."""
    if profile is None or max(profile.split_k) < 2:
        return
    from .onnx_split_k import split_matmuls_

    linear, head, attention = profile.split_k
    done = split_matmuls_(program, linear=linear, head=head, attention=attention)
    if counts is not None:
        counts.setdefault("groups", done.groups)
        for kind, n in done.split.items():
            counts.setdefault("split", {}).setdefault(kind, 0)
            counts["split"][kind] += n


def rewrite_for(profile, model, folder: Path) -> tuple[dict[str, dict], int]:
    """The exact graph-level rewrites `profile` needs, made on `model` in place before export: each norm prescaled
    where norm statistics are float16 (onnx_norms, measured on the folder's tokenizer and the embedded text), the
    head split where linears accumulate in float16 (onnx_accumulate; not where the profile splits K in the graph
    itself, onnx_split_k). Returns (prescales, head groups)."""
    from .onnx_accumulate import split_head_

    prescales = {}
    if profile.norm_stats_fp16:
        from .onnx_norms import calibration_ids, prescale_norms_

        ids = calibration_ids(folder, model.config.get_text_config().vocab_size)
        prescales = {n: p.to_dict() for n, p in prescale_norms_(model, profile, ids).items()}
    return prescales, 1 if max(profile.split_k) > 1 else split_head_(model, profile)


def add_onnx(folder: str | Path, runtime: str | None = None, final: str | Path | None = None) -> OnnxExportReport:
    """`halfsafe convert --to onnx`: add the ONNX files (`onnx/model_fp16.onnx`, or T5's encoder and decoder) to a
    converted checkpoint folder, beside its weights (the layout of a model repository that serves both transformers
    and transformers.js). `runtime`: as for export_onnx. `final`: where `folder` (the save's temporary folder) will
    be once complete: the report's path and the card name it."""
    from ..io.checkpoint import atomic_folder
    from ..io.report import seal
    from ..runtime.profiles import get_profile

    profile = get_profile(runtime)
    folder = check_source(folder)
    require_onnx()
    exporter = exporter_for(folder)
    model = exporter.load_fp16(folder)
    prescales, groups = rewrite_for(profile, model, folder)
    split = {}
    onnx_dir = folder / Path(ONNX_FILE).parent
    with atomic_folder(onnx_dir, replace=True) as tmp:
        for rel, program in exporter.programs(model):
            path = folder / rel
            split_graph(profile, program, split)
            save_program(program, tmp / Path(rel).name)
            del program
    final = Path(final) if final is not None else folder
    exporter.finish(folder, final.name)
    seal(folder)  # the ONNX files too, and config, tokenizer and card as they are now
    warning = not_converted_warning(folder)
    report = report_for(path, model.config.model_type, converted=warning is None, warning=warning)
    report.path = str(final / path.relative_to(folder))
    report.runtime, report.norm_prescales, report.head_groups, report.split_k = profile.name, prescales, groups, split
    return report


def report_for(path: Path, model_type: str, converted: bool, warning: str | None = None) -> OnnxExportReport:
    info = inspect_file(path)
    return OnnxExportReport(path=str(path), converted=converted, warning=warning, model_type=model_type, versions=versions(), **info)


# ----------------------------------------------------------------------------------------------------------------
# Running the exported graph: ONNX Runtime (fast; its CPU provider computes fp16 ops in fp32) and onnx's
# reference evaluator (slow; numpy in the tensors' own dtype, so fp16 stays fp16 and overflows as it would on an
# fp16 GPU / NPU).
# ----------------------------------------------------------------------------------------------------------------


class OnnxDecoder:
    """A decoder graph with the I/O `export_program` writes. backend: "ort" (ONNX Runtime, CPU) or "reference"
    (with `profile`, a runtime profile's float16 arithmetic: halfsafe.export.onnx_profile_ops)."""

    def __init__(self, model, backend: str = "ort", profile: str | None = None) -> None:
        import onnx

        self.backend = backend
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
        self.input_names = [i.name for i in proto.graph.input]
        self.output_names = [o.name for o in proto.graph.output]
        self.layers = sum(n.startswith("past_key_values.") and n.endswith(".key") for n in self.input_names)
        cache_in = next(i for i in proto.graph.input if i.name == "past_key_values.0.key")
        dims = cache_in.type.tensor_type.shape.dim
        self.kv_heads, self.head_dim = dims[1].dim_value, dims[3].dim_value
        self.dtype = onnx.helper.tensor_dtype_to_np_dtype(cache_in.type.tensor_type.elem_type)
        if backend == "ort":
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            data = proto.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
            self._session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        elif backend == "reference":
            from .onnx_profile_ops import profile_evaluator

            self._session = profile_evaluator(proto, profile)
        else:
            raise ValueError(f"backend must be 'ort' or 'reference', not {backend!r}")

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), self.dtype) for _ in range(2 * self.layers)]

    def step(self, ids: np.ndarray, cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward pass of `ids` [batch, new] after `cache`; returns logits [batch, new, vocab] and the new cache."""
        ids = np.asarray(ids, dtype=np.int64)
        batch, new = ids.shape
        past = cache[0].shape[2]
        feed = {
            "input_ids": ids,
            "attention_mask": np.ones((batch, past + new), np.int64),
            "position_ids": np.broadcast_to(np.arange(past, past + new, dtype=np.int64), (batch, new)).copy(),
        }
        for i in range(self.layers):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = cache[2 * i], cache[2 * i + 1]
        feed = {k: v for k, v in feed.items() if k in self.input_names}
        outs = dict(zip(self.output_names, self._session.run(None, feed)))
        present = [outs[f"present.{i}.{kind}"] for i in range(self.layers) for kind in ("key", "value")]
        return outs["logits"], present

    def logits(self, ids) -> np.ndarray:
        """Logits of a whole sequence in one pass (empty cache), [batch, seq, vocab]."""
        ids = np.asarray(ids, dtype=np.int64)
        return self.step(ids, self.empty_cache(ids.shape[0]))[0]

    def greedy(self, ids, new_tokens: int) -> list[int]:
        """Greedy tokens after `ids` [1, seq] with the KV cache: prefill once, then one token per step."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        logits, cache = self.step(ids, self.empty_cache(1))
        out = []
        for _ in range(new_tokens):
            token = int(np.argmax(logits[0, -1].astype(np.float32)))
            out.append(token)
            logits, cache = self.step(np.array([[token]], np.int64), cache)
        return out


# ----------------------------------------------------------------------------------------------------------------
# The clamp baseline: a Clip after each residual Add, as the published fp16 ONNX exports of Gemma 3 have
# ----------------------------------------------------------------------------------------------------------------


def _scopes(node) -> list[str]:
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            import ast

            return ast.literal_eval(p.value)
    return []


def residual_adds(proto, blocks: list[str]) -> list:
    """The Add nodes computed directly in a block's forward (not in a submodule): the residual adds.
    `blocks` are the block module names (`halfsafe.core.sites.find_blocks(model)`)."""
    blocks = set(blocks)
    out = []
    for node in proto.graph.node:
        scopes = _scopes(node)
        if node.op_type == "Add" and len(scopes) >= 2 and scopes[-2] in blocks:
            out.append(node)
    return out


def add_residual_clamps(proto, blocks: list[str], limit: float = 32752.0):
    """A copy of `proto` with `Clip(-limit, limit)` after every residual add (see `residual_adds`)."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    adds = {n.name for n in residual_adds(proto, blocks)}
    if not adds:
        raise HalfsafeError("no residual adds found in the graph: cannot build the clamp baseline")
    dtype = np.float16
    lo, hi = "halfsafe_clip_min", "halfsafe_clip_max"
    proto.graph.initializer.extend([numpy_helper.from_array(np.array(-limit, dtype), lo), numpy_helper.from_array(np.array(limit, dtype), hi)])
    nodes = list(proto.graph.node)
    new_nodes = []
    for node in nodes:
        new_nodes.append(node)
        if node.name in adds:
            raw = node.output[0]
            node.output[0] = raw + "_unclipped"
            new_nodes.append(helper.make_node("Clip", [node.output[0], lo, hi], [raw], name=node.name + "_clip"))
    del proto.graph.node[:]
    proto.graph.node.extend(new_nodes)
    return proto
