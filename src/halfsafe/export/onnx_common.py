"""What every ONNX exporter shares: the one call of transformers' OnnxExporter, the all-fp16 loader, the graph edits
each exporter makes on its inputs and outputs, and saving and inspecting a graph file.

The exporter is transformers' own `transformers.exporters.OnnxExporter` (torch.export, then torch.onnx's dynamo
exporter and onnxscript's optimizer), run on the model loaded all-fp16, so the graph computes exactly what PyTorch
computes in fp16: fp16 weights and activations, and the fp32 casts the modeling code itself makes (Gemma's RMSNorm).
optimum's ONNX exporter (optimum-onnx 0.1) needs transformers < 4.58, so it is not used.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..errors import HalfsafeError, UnsupportedModelError

EXPORTER = "transformers' OnnxExporter (torch.onnx dynamo)"
ONNX_FILE = "onnx/model_fp16.onnx"
EXTERNAL_DATA_SUFFIX = "_data"  # transformers.js names a model's external weights `<file>.onnx_data`
INLINE_LIMIT = 1_800_000_000  # protobuf holds at most 2 GiB: larger weights go to the external data file
SYMBOL = re.compile(r"\bs\d+\b")  # torch.export's symbols: s10, s54 + s70, ...


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


def load_exportable_fp16(folder: Path, check, model_class=None):
    """The checkpoint in `folder`, all-fp16 (no module kept in fp32), eval mode, once `check(config)` accepts it:
    the one loader of the three exports. `model_class` None: the class the config names."""
    from ..engine.shards import Shards
    from ..io.loading import model_class_for, read_config
    from ..io.trust import quiet_transformers
    from ..io.validate import check_config
    from ..runtime.fp16 import load_pure_fp16

    config = read_config(folder)
    check(config)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise HalfsafeError(f"{folder} has a config.json but no weights (*.safetensors): copy the weight files next to it")
    # as every load of a folder (io.loading): the files transformers reads, their dtypes, the config against them
    check_config(config, model_class_for(config), Shards(folder), folder)
    with quiet_transformers():
        model = load_pure_fp16(model_class or model_class_for(config), folder, local_files_only=True)
    return model.eval()


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


def name_dims(graph, table: dict) -> None:
    """Name the graph inputs' and outputs' free dimensions (`table`: by full name, else by the name's first part),
    and the same symbols in the values inside."""
    import onnx_ir as ir

    symbols: dict[str, str] = {}
    for value in list(graph.inputs) + list(graph.outputs):
        names = table.get(value.name) or table[value.name.split(".")[0]]
        dims = list(value.shape)
        for i, name in enumerate(names):
            if name is not None and not isinstance(dims[i], int):
                if dims[i].value is not None and SYMBOL.fullmatch(dims[i].value):
                    symbols.setdefault(dims[i].value, name)
                dims[i] = ir.SymbolicDim(name)
        value.shape = ir.Shape(dims)
    io = set(graph.inputs) | set(graph.outputs)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.outputs:
            if value.shape is None or value in io:
                continue
            dims = [d if isinstance(d, int) or d.value is None else ir.SymbolicDim(SYMBOL.sub(lambda m: symbols.get(m.group(0), m.group(0)), d.value))
                    for d in value.shape]
            value.shape = ir.Shape(dims)


def float32_output(graph, name: str = "logits") -> None:
    """A Cast of the fp16 output `name` to float32 as the graph's `name` (the fp16 graph is unchanged): transformers.js
    3.x in Node (no Float16Array) reads fp16 logits as their raw bits."""
    import onnx_ir as ir

    index = next(i for i, v in enumerate(graph.outputs) if v.name == name)
    fp16 = graph.outputs[index]
    fp16.name = f"{name}_fp16"
    out = ir.Value(name=name, shape=fp16.shape, type=ir.TensorType(ir.DataType.FLOAT))
    graph.append(ir.node("Cast", [fp16], {"to": ir.DataType.FLOAT}, outputs=[out], name=f"halfsafe_{name}_float32"))
    graph.outputs[index] = out


def save_program(program, path: Path) -> None:
    """Save inline when the weights fit in one protobuf, else beside it as `<file>_data` (transformers.js's name)."""
    import onnx_ir

    path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(v.const_value.nbytes for v in program.graph.initializers.values() if v.const_value is not None)
    if weight_bytes < INLINE_LIMIT:
        onnx_ir.save(program, str(path))
    else:
        onnx_ir.save(program, str(path), external_data=path.name + EXTERNAL_DATA_SUFFIX)


def has_external_data(path: Path) -> bool:
    """`path`'s weights were saved beside it (`save_program`)."""
    return path.with_name(path.name + EXTERNAL_DATA_SUFFIX).exists()


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


def clip_nodes(folder: Path, files: list[str]) -> int:
    """The Clip nodes of the graph files `files` in `folder`, together (the card says how many)."""
    return sum(inspect_file(folder / f)["clip_nodes"] for f in files)
