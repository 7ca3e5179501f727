"""Small, pure utilities over ONNX graphs: types, producers, slices and reachability.

Every stage of lazygrad (export, gradient building, splitting, stash planning) asks the same few
questions of a graph: which node makes this tensor, which nodes are needed to make these tensors
from those, which tensors can carry a gradient from these sources. They live here once.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import TensorProto

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)

# Ops whose outputs are drawn at random: replaying them gives a different draw, so their outputs
# are always stashed, never recomputed (a recomputed Dropout would not match the forward's mask).
RANDOM_OPS = frozenset(
    {"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
     "Bernoulli", "Multinomial", "BiasDropout", "BitmaskDropout"}
)

# Optional outputs that ORT's gradient builder reads but the TorchScript exporter leaves out
# (measured: the builder fails with `i < node_->OutputDefs().size()` without them).
OPTIONAL_OUTPUTS_FOR_GRADIENT = {
    "LayerNormalization": ("mean", "inv_std_dev"),
    "SoftmaxCrossEntropyLoss": ("log_prob",),
    "Dropout": ("mask",),
}


def tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Type of every named tensor of the graph, from ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        types[value.name] = value.type
    for init in graph.initializer:
        types.setdefault(init.name, onnx.helper.make_tensor_type_proto(init.data_type, init.dims))
    return types


def elem_type(type_proto: onnx.TypeProto) -> int:
    return type_proto.tensor_type.elem_type


def producers(nodes: Iterable[onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
    """Map each tensor name to the node that writes it."""
    return {out: node for node in nodes for out in node.output if out}


def produced_names(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    return {out for node in nodes for out in node.output if out}


def consumed_names(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    return {name for node in nodes for name in node.input if name}


def slice_nodes(
    nodes: list[onnx.NodeProto], targets: Iterable[str], available: set[str]
) -> list[onnx.NodeProto]:
    """Nodes (in graph order) needed to compute `targets` when `available` tensors are given."""
    made_by = producers(nodes)
    needed: set[int] = set()
    stack = [t for t in targets if t not in available]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in available:
            continue
        seen.add(name)
        node = made_by.get(name)
        if node is None:
            continue  # a graph input or an initializer
        if id(node) in needed:
            continue
        needed.add(id(node))
        stack.extend(i for i in node.input if i)
    return [node for node in nodes if id(node) in needed]


def differentiable_reach(
    nodes: list[onnx.NodeProto], sources: Iterable[str], types: dict[str, onnx.TypeProto]
) -> set[str]:
    """Tensors a gradient can flow to from `sources`: forward reachability over float tensors.

    An integer or boolean tensor (a Shape, an ArgMax, a comparison) carries no gradient, so the
    walk stops there; this is what keeps the gradient builder from being asked about inputs it
    would call unreachable.
    """
    reached = set(sources)
    for node in nodes:  # ONNX graphs are topologically sorted
        if any(name in reached for name in node.input if name):
            for out in node.output:
                if out and out in types and elem_type(types[out]) in FLOAT_TYPES:
                    reached.add(out)
    return reached


def with_optional_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Copy of `model` whose nodes carry the optional outputs ORT's gradient builder needs."""
    model = _copy(model)
    for index, node in enumerate(model.graph.node):
        wanted = OPTIONAL_OUTPUTS_FOR_GRADIENT.get(node.op_type)
        if not wanted or node.domain not in ("", "ai.onnx"):
            continue
        while len(node.output) < 1 + len(wanted):
            suffix = wanted[len(node.output) - 1]
            node.output.append(f"{node.output[0]}__{suffix}_{index}")
    return model


def without_optional_outputs(model: onnx.ModelProto, keep: set[str]) -> onnx.ModelProto:
    """Copy of `model` without the optional outputs added for the gradient builder, except `keep`.

    A forward run that computes SoftmaxCrossEntropyLoss's log_prob when no backward reads it
    pays a vocabulary-sized tensor for nothing.
    """
    model = _copy(model)
    consumed = consumed_names(model.graph.node) | {out.name for out in model.graph.output}
    for node in model.graph.node:
        if node.op_type not in OPTIONAL_OUTPUTS_FOR_GRADIENT or node.op_type in RANDOM_OPS:
            continue
        outputs = list(node.output)
        for index in range(1, len(outputs)):
            if outputs[index] not in keep and outputs[index] not in consumed:
                outputs[index] = ""
        while len(outputs) > 1 and not outputs[-1]:
            outputs.pop()
        del node.output[:]
        node.output.extend(outputs)
    return model


def random_outputs(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    return {out for node in nodes if node.op_type in RANDOM_OPS for out in node.output if out}


def value_info(name: str, type_proto: onnx.TypeProto) -> onnx.ValueInfoProto:
    info = onnx.ValueInfoProto()
    info.name = name
    info.type.CopyFrom(type_proto)
    return info


def make_model(
    template: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto],
    name: str,
) -> onnx.ModelProto:
    """A model with `template`'s opsets and IR version around the given graph parts."""
    graph = onnx.helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = onnx.helper.make_model(graph, opset_imports=list(template.opset_import))
    model.ir_version = template.ir_version
    return model


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
