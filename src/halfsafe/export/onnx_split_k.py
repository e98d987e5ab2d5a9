"""Split-K: each matrix product's K split into G consecutive groups, one batched MatMul, the G partial products added
pairwise. For runtimes whose float16 MatMul keeps a float16 running sum over K (ONNX Runtime's WebGPU provider).

x W = sum_g x[..., K_g] W[K_g, :] holds exactly in real arithmetic, so the graph computes the same function. A float16
running sum over K terms rounds at the size of its partial sums once per term, its error growing like sqrt(K); over
K / G terms each group's sum rounds less often, and the G partials meet in a log2(G)-deep float16 tree. The rewrite
is made on the exported ONNX graph (an onnx_ir model, before it is saved):

    x [.., K] -> Reshape [.., G, K/G] -> Transpose [G, .., K/G]   \
                                                                     MatMul [G, .., N] -> Split/Add (pairwise) -> [.., N]
    W [K, N]  -> Reshape [G, 1.., K/G, N]                          /

W's Reshape is of a constant (a weight): the stored weights are the same float16 bytes, and ONNX Runtime folds the
Reshape once at load. One MatMul per product keeps the node count small (4 + 2 log2 G nodes per product) and lets the
runtime run the groups as one batched dispatch. The head is split into G MatMuls of slices instead (its output is
the vocabulary wide: G batched partials would cost G times the logits' memory), of the tied embedding's Transpose.

Kinds of product: `linear` (a weight as B), `head` (the product that makes the logits) and `attention` (both inputs
computed, K static: QK^T over the head dimension). Each product's G is a power of two dividing its K, chosen by a
SplitK (halfsafe.runtime.profiles, the rule the emulation follows too) from its kind and K: at most T terms per
running sum (`terms`), or a count per kind; a product whose G is 1 is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..runtime.profiles import SplitK

PREFIX = "halfsafe_splitk"


@dataclass
class SplitReport:
    rule: dict = field(default_factory=dict)  # the SplitK's to_dict
    groups: dict[str, dict[int, int]] = field(default_factory=dict)  # kind -> {K: G} of the products rewritten
    split: dict[str, int] = field(default_factory=dict)  # kind -> products rewritten

    def to_dict(self) -> dict:
        return {"rule": dict(self.rule), "groups": {k: dict(v) for k, v in self.groups.items()}, "split": dict(self.split)}


def _static_dim(shape, i: int) -> int | None:
    if shape is None or len(shape) == 0:
        return None
    d = shape[i]
    return d if isinstance(d, int) else None


def head_matmul(graph, output: str = "logits"):
    """The MatMul the graph's `output` comes from (through casts and elementwise ops such as a logit soft-cap)."""
    outs = {v.name: v for v in graph.outputs}
    todo, seen = [outs[output]] if output in outs else [], set()
    while todo:
        value = todo.pop(0)
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "MatMul":
            return node
        todo.extend(v for v in node.inputs if v is not None and not v.is_initializer())
    return None


def kind_of(node, head) -> str | None:
    """`linear`, `head`, `attention` or None (a product this rewrite leaves alone)."""
    if node.op_type != "MatMul":
        return None
    if node is head:
        return "head"
    a, b = node.inputs
    b_shape = b.shape
    if b_shape is not None and len(b_shape) == 2 and all(isinstance(d, int) for d in b_shape) and _is_constant(b):
        return "linear"
    if a.shape is not None and len(a.shape) >= 3 and b.shape is not None and len(b.shape) == len(a.shape):
        return "attention"
    return None


def _is_constant(value, depth: int = 4) -> bool:
    """An initializer, or an op of initializers only (the tied head's Transpose of the embedding)."""
    if value.is_initializer() or value.const_value is not None:
        return True
    node = value.producer()
    if node is None or depth == 0 or node.op_type not in ("Transpose", "Reshape", "Cast", "Identity"):
        return False
    return all(_is_constant(v, depth - 1) for v in node.inputs if v is not None)


def _const(ir, name: str, values) -> tuple:
    out = ir.Value(name=name)
    return ir.node("Constant", [], {"value": ir.tensor(np.asarray(values, dtype=np.int64), name=name)}, outputs=[out],
                   name=f"{name}_node"), out


class _Builder:
    """Nodes named after the product they replace, collected in order."""

    def __init__(self, ir, base: str) -> None:
        self.ir, self.base, self.nodes, self.n = ir, base, [], 0

    def name(self, what: str) -> str:
        self.n += 1
        return f"{PREFIX}/{self.base}/{what}_{self.n}"

    def const(self, values):
        node, out = _const(self.ir, self.name("shape"), values)
        self.nodes.append(node)
        return out

    def op(self, op_type: str, inputs, attrs=None, outputs: int = 1, out_values=None):
        names = [self.name(op_type.lower()) for _ in range(outputs)]
        outs = out_values or [self.ir.Value(name=n) for n in names]
        self.nodes.append(self.ir.node(op_type, inputs, attrs or {}, outputs=outs, name=self.name(op_type)))
        return outs if outputs > 1 else outs[0]


def _sliced_head(bld, a, b, k: int, g: int):
    """The head: G MatMuls of slices, each [.., M, vocab]; a batched one would hold G times the logits at once (G x
    48 tokens x 262144 x 2 bytes is 384 MiB for Gemma 3 at G = 16). Built so that a partial is added as soon as its
    pair exists (a binary counter), which keeps at most log2(G) + 1 partials alive."""
    stack = []  # (level, value)
    for i in range(g):
        lo, hi = bld.const([i * k // g]), bld.const([(i + 1) * k // g])
        a_i = bld.op("Slice", [a, lo, hi, bld.const([-1])])
        b_i = bld.op("Slice", [b, lo, hi, bld.const([0])])
        part, level = bld.op("MatMul", [a_i, b_i]), 0
        while stack and stack[-1][0] == level:
            part, level = bld.op("Add", [stack.pop()[1], part]), level + 1
        stack.append((level, part))
    assert len(stack) == 1  # g is a power of two
    return stack[0][1]


def _split_one(graph, node, split: SplitK, kind: str) -> int:
    """The product `node` rewritten with its K in the groups `split` gives it; returns its K (0: left as it is)."""
    import onnx_ir as ir

    a, b = node.inputs
    rank = len(a.shape) if a.shape is not None else 0
    k = _static_dim(a.shape, -1)
    if rank < 2 or k is None:
        return 0
    g = split.groups_for(kind, k)
    if g < 2:
        return 0
    bld = _Builder(ir, node.name or "matmul")
    out = node.outputs[0]
    if kind == "head":
        if _static_dim(b.shape, 0) != k:
            return 0
        result = ir.Value(name=bld.name("sum"), shape=out.shape, type=out.type)
        bld.op("Identity", [_sliced_head(bld, a, b, k, g)], out_values=[result])
        return _replace(graph, node, bld, result) and k
    # A [.., M, K] -> [G, .., M, K/G]: K's consecutive runs become the leading batch axis
    a_g = bld.op("Reshape", [a, bld.const([0] * (rank - 1) + [g, k // g])])
    a_g = bld.op("Transpose", [a_g], {"perm": [rank - 1, *range(rank - 1), rank]})
    if kind == "attention":  # B [.., K, N] -> [G, .., K/G, N]
        b_g = bld.op("Reshape", [b, bld.const([0] * (rank - 2) + [g, k // g, -1])])
        b_g = bld.op("Transpose", [b_g], {"perm": [rank - 2, *range(rank - 2), rank - 1, rank]})
    else:  # a constant [K, N] -> [G, 1.., K/G, N], broadcast over A's batch axes
        n = _static_dim(b.shape, -1)
        if n is None or _static_dim(b.shape, 0) != k:
            return 0
        b_g = bld.op("Reshape", [b, bld.const([g] + [1] * (rank - 2) + [k // g, n])])
    parts = bld.op("MatMul", [a_g, b_g])
    while g > 1:  # pairwise: each level halves the groups with one float16 add per element
        g //= 2
        lo, hi = bld.op("Split", [parts, bld.const([g, g])], {"axis": 0}, outputs=2)
        parts = bld.op("Add", [lo, hi])
    result = ir.Value(name=bld.name("sum"), shape=out.shape, type=out.type)
    bld.op("Squeeze", [parts, bld.const([0])], out_values=[result])
    return _replace(graph, node, bld, result) and k


def _replace(graph, node, bld, result) -> bool:
    out = node.outputs[0]
    graph.insert_before(node, bld.nodes)
    if out.is_graph_output():  # first: onnx_ir refuses to replace the uses of a graph output
        graph.outputs[graph.outputs.index(out)] = result
        result.name, out.name = out.name, f"{out.name}_unsplit"
    out.replace_all_uses_with(result)
    graph.remove(node, safe=True)
    return True


def split_matmuls_(model, split: SplitK | None = None, *, linear: int = 1, head: int = 1,
                   attention: int = 1) -> SplitReport:
    """Rewrite `model`'s (an onnx_ir.Model) matrix products in place, each product's K in the groups `split` gives
    it (None: SplitK(groups=(linear, head, attention)), a count per kind; 1: as it is)."""
    split = split if split is not None else SplitK(groups=(linear, head, attention))
    graph = model.graph
    report = SplitReport(rule=split.to_dict())
    top = head_matmul(graph)
    for node in list(graph):
        kind = kind_of(node, top)
        if kind is None:
            continue
        k = _split_one(graph, node, split, kind)
        if k:
            report.split[kind] = report.split.get(kind, 0) + 1
            report.groups.setdefault(kind, {})[k] = split.groups_for(kind, k)
    return report
