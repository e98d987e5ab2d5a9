"""The clamp baseline: a Clip after each residual Add, as the published fp16 ONNX exports of Gemma 3 have."""

from __future__ import annotations

import numpy as np

from ..errors import HalfsafeError


def name_scopes(node) -> list[str]:
    """The module scopes torch.onnx recorded for `node`, outermost first."""
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
        scopes = name_scopes(node)
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
