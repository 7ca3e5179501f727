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
row aside), in one buffer. A tied weight's gradient (BERT's and GPT-2's word embeddings are their
output layers' weights) is the scatter's sum with the output layer's gradient, one more buffer
in ORT: the graph returns that gradient, the additions and the indices, and torch adds into it in
place. The outputs so returned, and how to add into each, are in the model's metadata.
"""

from __future__ import annotations

import collections
import json

import onnx
import onnx.helper
import onnx.numpy_helper

from lazygrad.capture.node_order import attribute, is_standard, node_inputs, static_shape
from lazygrad.capture.onnx_constants import constant_tensors
from lazygrad.capture.reshaped_outputs import outputs_made_by_sources

# The model's metadata key: JSON, output name -> [its indices' output name, axis, the
# gradient's shape, its additions' output name or null] (`scattered`).
SCATTERED_OUTPUTS = "lazygrad.scattered_outputs"


def added_in_torch(model: onnx.ModelProto, final: set[str]) -> onnx.ModelProto:
    """`model` (changed in place) where each output named in `final` that a ScatterElements
    adding into zeros of a constant shape makes is made by the additions' producer instead (its
    shape left unknown), or, where it is such a scatter plus a tensor of the zeros' shape (a
    tied weight's gradient: the embedding's and the output layer's), by that tensor's producer,
    the additions an output of their own; the zeros, the scatter and the sum are not made, and
    the indices are an output too. Each value renamed or dropped is read by nothing else.
    `final`: the whole backward's outputs that no node reads."""
    graph = model.graph
    readers = collections.Counter(name for node in graph.node for name in node_inputs(node))
    made_by = {output: node for node in graph.node for output in node.output}
    outputs = {value.name for value in graph.output}
    constants = constant_tensors(graph)
    shapes = {value.name: static_shape(value) for value in graph.value_info}
    types = {value.name: value.type.tensor_type.elem_type
             for value in (*graph.input, *graph.value_info) if value.type.tensor_type.elem_type}

    def only_read_once(name: str) -> bool:
        return name in made_by and readers[name] == 1 and name not in outputs

    renamed: dict[str, str] = {}  # a value -> the output it becomes
    dropped: set[int] = set()
    found: dict[str, list] = {}
    extra: dict[str, int] = {}  # values that become outputs of their own -> element type
    for value in graph.output:
        node = made_by.get(value.name)
        if value.name not in final or node is None:
            continue
        into_zeros = _into_zeros(node, made_by, readers, constants)
        if into_zeros is not None:
            scatter, shape, chain = into_zeros
            _, indices, added = scatter.input
            if only_read_once(added):
                renamed[added] = value.name
                dropped.update(map(id, chain))
                found[value.name] = [indices, attribute(scatter, "axis", 0), shape, None]
                extra[indices] = types.get(indices, onnx.TensorProto.INT64)
            continue
        if not is_standard(node, "Add"):
            continue
        for summand, base in (node.input, reversed(node.input)):
            into_zeros = _into_zeros(made_by.get(summand), made_by, readers, constants)
            if into_zeros is None or readers[summand] != 1 or not only_read_once(base):
                continue
            scatter, shape, chain = into_zeros
            _, indices, added = scatter.input
            if shapes.get(base) != tuple(shape) or added not in made_by:
                continue
            renamed[base] = value.name
            dropped.update({id(node), *map(id, chain)})
            found[value.name] = [indices, attribute(scatter, "axis", 0), shape, added]
            extra[indices] = types.get(indices, onnx.TensorProto.INT64)
            extra[added] = value.type.tensor_type.elem_type  # the scatter's, the sum's
            break
    if not found:
        return model
    outputs_made_by_sources(graph, renamed, dropped)
    for value in graph.output:
        if value.name in found and found[value.name][3] is None:
            value.type.tensor_type.ClearField("shape")
    for name, elem_type in extra.items():
        if name not in outputs:
            graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    model.metadata_props.add(key=SCATTERED_OUTPUTS, value=json.dumps(found, sort_keys=True))
    return model


def _into_zeros(node: onnx.NodeProto | None, made_by: dict, readers: collections.Counter,
                constants: dict[str, onnx.TensorProto]
                ) -> tuple[onnx.NodeProto, list[int], list[onnx.NodeProto]] | None:
    """(the scatter, the zeros' shape, the nodes that make them and it) where `node` is a
    ScatterElements adding into zeros of a constant shape; else None."""
    if not is_standard(node, "ScatterElements") or attribute(node, "reduction") != b"add":
        return None
    zeros = _zeros(node.input[0], made_by, readers, constants)
    if zeros is None:
        return None
    shape, chain = zeros
    return node, shape, [node, *chain]


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


def scattered(model: onnx.ModelProto) -> dict[str, tuple[str, int, list[int], str | None]]:
    """The outputs of `model` that `added_in_torch` changed: name -> (the indices' output name,
    axis, the gradient's shape, the additions' output name; None where the output is the
    additions, to add into zeros)."""
    found = {}
    for entry in model.metadata_props:
        if entry.key == SCATTERED_OUTPUTS:
            found.update({name: tuple(how) for name, how in json.loads(entry.value).items()})
    return found


def outputs_involved(model: onnx.ModelProto) -> set[str]:
    """Every output `added_in_torch` changed or added (the gradients, their indices and
    additions): later rewrites leave their shapes alone, as torch adds them as they are."""
    return {name for output, (indices, _, _, added) in scattered(model).items()
            for name in (output, indices, added) if name is not None}
