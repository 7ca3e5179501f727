"""A graph output copied by an Identity is made by the Identity's source instead.

`x.transpose(1, 2).contiguous()` (attention's heads, kept for the backward) is traced as a
transpose and a `clone`, and exported as a Transpose and an Identity. ORT gives a graph output a
buffer of its own, so it copies an Identity whose result is one: 16 copies of the heads per
forward of the BERT-shaped benchmark model, 1.8 ms of its step. The Transpose's result is a
tensor of its own already (ONNX has no views), so its node makes the output directly, under the
output's name, and the nodes that read it read that name. The trace's matmul puts an Expand to
the same shape between the two (`expand` before `bmm`), which ORT drops as a no-op: it is
looked through, as it would copy in the Identity's place as the output's maker.
"""

from __future__ import annotations

import onnx

from lazygrad.capture.node_order import branch_inputs, is_standard, node_inputs
from lazygrad.capture.reshaped_outputs import outputs_made_by_sources


def made_by_their_source(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place) where each graph output that an Identity makes from a value
    another node of the graph makes (not itself an output, nor read inside a subgraph) is made
    by that node, and the Identity is dropped."""
    graph = model.graph
    made_by = {output: node for node in graph.node for output in node.output}
    outputs = {value.name for value in graph.output}
    in_subgraphs = {name for node in graph.node for name in branch_inputs(node)}
    shapes = {value.name: _shape(value) for value in
              (*graph.input, *graph.value_info, *graph.output)}
    renamed: dict[str, str] = {}  # the Identity's source -> the output it becomes
    passed: list[onnx.NodeProto] = []  # the Expands looked through
    for value in graph.output:
        node = made_by.get(value.name)
        if node is None or not is_standard(node, "Identity"):
            continue
        source = node.input[0]
        expands = []
        while source in made_by and is_standard(made_by[source], "Expand") \
                and shapes.get(made_by[source].input[0]) == shapes.get(source) is not None:
            expands.append(made_by[source])
            source = made_by[source].input[0]
        if source in made_by and source not in outputs and source not in in_subgraphs \
                and source not in renamed:
            renamed[source] = value.name
            passed.extend(expands)
    if not renamed:
        return model
    dropped = {id(made_by[output]) for output in renamed.values()}
    while unread := [node for node in passed if id(node) not in dropped
                     and node.output[0] not in _read(graph, dropped) | in_subgraphs | outputs]:
        dropped |= {id(node) for node in unread}  # an Expand only the Identity read
    outputs_made_by_sources(graph, renamed, dropped)
    return model


def _read(graph: onnx.GraphProto, dropped: set[int]) -> set[str]:
    return {name for node in graph.node if id(node) not in dropped for name in node_inputs(node)}


def _shape(value: onnx.ValueInfoProto) -> tuple | None:
    """The value's shape, each size a number or a symbol's name; None unless every size is
    known."""
    if not value.type.tensor_type.HasField("shape"):
        return None
    sizes = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None
                  for d in value.type.tensor_type.shape.dim)
    return None if None in sizes else sizes
