"""Node order, after to_onnx and segment: a backward graph ORT runs in the order its nodes are in.

ORT's default execution order is a depth-first walk back from the graph's outputs, which puts a
bias gradient's reduction, a leaf, after the whole chain of lower layers: its input (on the
BERT-shaped workload B, the vocabulary-sized gradient of the logits, and every layer's
feed-forward intermediate) stays allocated until the run's end. The session runs the backward
with `ExecutionOrder.PRIORITY_BASED` instead (session.py): ready nodes in the graph's own order,
which is autograd's (AOTAutograd's backward) or segment.py's. Nodes that ORT adds while loading
are appended after every other node, so in that order they would run last; so their two sources
are settled here, in place:

- function calls (the exporter's translations of some ops) are inlined (`onnx.inliner`);
- a MatMul that reads a Transpose of its operand's last two dimensions becomes the FusedMatMul
  ORT's own MatmulTransposeFusion would make of it (transA/transB), in the MatMul's place.

First backward segment of workload B, peak over its inputs: 208 MiB in the default order, 189
with these two, 139 with both and the graph's order.
"""

from __future__ import annotations

from typing import Any

import onnx
import onnx.helper
import onnx.inliner

ORT_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (FusedMatMul, Gelu), CPU and CUDA


def is_standard(node: onnx.NodeProto | None, op_type: str) -> bool:
    """Whether `node` is the standard ONNX operator `op_type` (not a contrib op of that name)."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of `node`'s attribute `name` (a list for `ints`), or `default` where unset."""
    found = [a for a in node.attribute if a.name == name]
    return onnx.helper.get_attribute_value(found[0]) if found else default


def static_shape(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    """The value's shape where every size is a number; else None."""
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return None
    dims = value.type.tensor_type.shape.dim
    if any(not dim.HasField("dim_value") for dim in dims):
        return None
    return tuple(dim.dim_value for dim in dims)


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """The names `node` reads from its graph: its inputs and its subgraphs' (`branch_inputs`).
    A rewrite that counts a value's readers counts these, or it drops a value a branch reads."""
    return [*node.input, *branch_inputs(node)]


def branch_inputs(node: onnx.NodeProto) -> list[str]:
    """The names `node`'s subgraphs (an If's branches, `zero_where.py`'s among them) read from
    the graphs around them. A rewrite that renames values in the graph leaves these alone."""
    names = []
    for field in node.attribute:
        for subgraph in (*field.graphs, *([field.g] if field.HasField("g") else [])):
            inner = {value.name for value in (*subgraph.input, *subgraph.initializer)}
            inner.update(name for inner_node in subgraph.node for name in inner_node.output)
            names.extend(name for inner_node in subgraph.node for name in node_inputs(inner_node)
                         if name not in inner)
    return names


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every local function call replaced by the function's nodes, in its place."""
    return onnx.inliner.inline_local_functions(model) if model.functions else model


def fuse_transposed_matmuls(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place) with each MatMul of a last-two-dimensions Transpose made a
    FusedMatMul reading the Transpose's input; a Transpose nothing else reads is dropped."""
    graph = model.graph
    made_by = {output: node for node in graph.node for output in node.output}
    nodes, fused = [], 0
    for node in graph.node:
        if is_standard(node, "MatMul"):
            (a, trans_a), (b, trans_b) = (_untransposed(name, made_by) for name in node.input)
            if trans_a or trans_b:
                node = onnx.helper.make_node(
                    "FusedMatMul", [a, b], list(node.output), name=node.name,
                    domain=ORT_DOMAIN, transA=trans_a, transB=trans_b, alpha=1.0,
                )
                fused += 1
        nodes.append(node)
    if not fused:
        return model
    read = {name for node in nodes for name in node_inputs(node)} | {v.name for v in graph.output}
    nodes = [n for n in nodes if n.op_type != "Transpose" or n.output[0] in read]
    del graph.node[:]
    graph.node.extend(nodes)
    import_ort_domain(model)
    return model


def import_ort_domain(model: onnx.ModelProto) -> None:
    """Declare ORT's contrib-op domain in `model`, once."""
    if not any(opset.domain == ORT_DOMAIN for opset in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))


def _untransposed(name: str, made_by: dict[str, onnx.NodeProto]) -> tuple[str, int]:
    """(the tensor to read, 1 if it is to be read transposed): `name`'s Transpose input when
    `name` is a Transpose that swaps only the last two dimensions."""
    node = made_by.get(name)
    if not is_standard(node, "Transpose"):
        return name, 0
    perm = attribute(node, "perm")
    rank = len(perm) if perm else 0
    swaps_last_two = rank >= 2 and perm == [*range(rank - 2), rank - 1, rank - 2]
    return (node.input[0], 1) if swaps_last_two else (name, 0)
