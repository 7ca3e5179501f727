"""A backward output that a scatter-add into zeros makes is returned as its additions and their
indices; torch adds them into the gradient's one buffer.

An embedding's weight gradient (`lowerings.accumulate_rows`: the backward's accumulating
index_put, as scatter_add) is ScatterElements(zeros, indices, added, reduction="add"). ORT's
ScatterElements copies its data into a new output before adding, so the zeros and the gradient
are two buffers of the weight's size at once, where eager adds into one
(`embedding_dense_backward`'s `index_add_`): 29 MiB more at the backward of workload A's 30,000 x
256 vocabulary, 147 MiB on GPT-2's (50,257 x 768). The graph returns the additions and the
indices instead, and `GraphPair.backward` makes the gradient as
`zeros(shape).scatter_add_(axis, indices, added)`: the same sums (the order of additions into one
row aside), in one buffer. The outputs so returned, and how to scatter each, are in the model's
metadata.
"""

from __future__ import annotations

import collections
import json

import onnx
import onnx.helper
import onnx.numpy_helper

from lazygrad.capture.node_order import attribute, is_standard, node_inputs
from lazygrad.capture.onnx_constants import constant_tensors
from lazygrad.capture.reshaped_outputs import outputs_made_by_sources

# The model's metadata key: JSON, output name -> [its indices' output name, axis, shape].
SCATTERED_OUTPUTS = "lazygrad.scattered_outputs"


def added_in_torch(model: onnx.ModelProto, final: set[str]) -> onnx.ModelProto:
    """`model` (changed in place) where each output named in `final` that a ScatterElements
    adding into zeros of a constant shape makes, from additions nothing else reads, is made by
    the additions' producer instead (its shape left unknown), the zeros are not made, and the
    indices are an output too. `final`: the whole backward's outputs that no node reads."""
    graph = model.graph
    readers = collections.Counter(name for node in graph.node for name in node_inputs(node))
    made_by = {output: node for node in graph.node for output in node.output}
    outputs = {value.name for value in graph.output}
    constants = constant_tensors(graph)
    renamed: dict[str, str] = {}  # the additions -> the output they become
    dropped: set[int] = set()
    found: dict[str, list] = {}
    for value in graph.output:
        node = made_by.get(value.name)
        if value.name not in final or not is_standard(node, "ScatterElements") \
                or attribute(node, "reduction") != b"add":
            continue
        data, indices, added = node.input
        zeros = _zeros(data, made_by, readers, constants)
        if zeros is None or added not in made_by or readers[added] != 1 or added in outputs:
            continue
        shape, chain = zeros
        renamed[added] = value.name
        dropped.update({id(node), *map(id, chain)})
        found[value.name] = [indices, attribute(node, "axis", 0), shape]
    if not found:
        return model
    outputs_made_by_sources(graph, renamed, dropped)
    for value in graph.output:
        if value.name in found:
            value.type.tensor_type.ClearField("shape")
    types = {value.name: value.type.tensor_type.elem_type
             for value in (*graph.input, *graph.value_info)}
    for indices in dict.fromkeys(entry[0] for entry in found.values()):
        if indices not in outputs:
            graph.output.append(onnx.helper.make_tensor_value_info(
                indices, types.get(indices) or onnx.TensorProto.INT64, None))
    model.metadata_props.add(key=SCATTERED_OUTPUTS, value=json.dumps(found, sort_keys=True))
    return model


def _zeros(name: str, made_by: dict, readers: collections.Counter,
           constants: dict[str, onnx.TensorProto]) -> tuple[list[int], list] | None:
    """(shape, the nodes that make it) where `name` is ConstantOfShape(shape) of zeros, through
    Casts or CastLikes, each read once; else None."""
    chain = []
    node = made_by.get(name)
    while (is_standard(node, "Cast") or is_standard(node, "CastLike")) \
            and readers[node.output[0]] == 1:
        chain.append(node)
        node = made_by.get(node.input[0])
    if not is_standard(node, "ConstantOfShape") or readers[node.output[0]] != 1 \
            or node.input[0] not in constants:
        return None
    value = attribute(node, "value")
    if value is not None and onnx.numpy_helper.to_array(value).any():
        return None
    return onnx.numpy_helper.to_array(constants[node.input[0]]).tolist(), [*chain, node]


def scattered(model: onnx.ModelProto) -> dict[str, tuple[str, int, list[int]]]:
    """The outputs of `model` that `added_in_torch` returns as additions: name -> (the indices'
    output name, axis, the gradient's shape)."""
    found = {}
    for entry in model.metadata_props:
        if entry.key == SCATTERED_OUTPUTS:
            found.update({name: (indices, axis, shape)
                          for name, (indices, axis, shape) in json.loads(entry.value).items()})
    return found
