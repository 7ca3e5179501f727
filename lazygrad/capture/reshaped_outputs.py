"""A backward output made by a Reshape is returned as the Reshape's input, viewed in torch.

ORT copies a Reshape whose result is a graph output (an output gets its own buffer). A
convolution's weight gradient ends in one (`lowerings._weight_gradient_by_products` stacks its
[C_out, C_in] products and views them as the kernel's shape): on a ResNet-18 step the three
[512, 512, 3, 3] copies alone took 10 ms of ORT's kernel time (a fresh 9 MiB buffer each,
page-faulted in). `GraphPair.backward` views each gradient as its primal's shape, which is free
on ORT's contiguous result (the outputs it views are named in the model's metadata).
"""

from __future__ import annotations

import onnx

from lazygrad.capture.node_order import node_inputs
from lazygrad.session import COMPLEX_OUTPUTS

# The model's metadata key listing, comma-separated, the outputs returned before their Reshape:
# only those are viewed (a gradient of another shape is an error, not a view).
UNRESHAPED_OUTPUTS = "lazygrad.unreshaped_outputs"


def unreshaped_outputs(model: onnx.ModelProto, final: set[str]) -> onnx.ModelProto:
    """`model` (changed in place) where each output named in `final` that a Reshape makes, from
    a value nothing else reads, is made by that value's producer instead, its shape left unknown
    and its name listed in the metadata. `final`: the whole backward's outputs that no node
    reads (a segment's outputs that later segments read keep their shapes)."""
    graph = model.graph
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node_inputs(node):
            readers[name] = readers.get(name, 0) + 1
    made_by = {output: node for node in graph.node for output in node.output}
    outputs = {value.name for value in graph.output}
    # A complex gradient leaves ORT as its real pairs, viewed as complex by their last axis:
    # that axis must stay.
    complex_outputs = {name for entry in model.metadata_props if entry.key == COMPLEX_OUTPUTS
                       for name in entry.value.split(",")}
    renamed: dict[str, str] = {}  # the Reshape's input -> the output it becomes
    for value in graph.output:
        node = made_by.get(value.name)
        if value.name not in final or value.name in complex_outputs or node is None \
                or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.input[0]
        if source in made_by and readers.get(source) == 1 and source not in outputs:
            renamed[source] = value.name
    if not renamed:
        return model
    outputs_made_by_sources(graph, renamed, {id(made_by[output]) for output in renamed.values()})
    for value in graph.output:
        if value.name in renamed.values():
            value.type.tensor_type.ClearField("shape")
    model.metadata_props.add(key=UNRESHAPED_OUTPUTS, value=",".join(sorted(renamed.values())))
    return model


def outputs_made_by_sources(graph: onnx.GraphProto, renamed: dict[str, str],
                            dropped: set[int]) -> None:
    """`graph` (changed in place) without the nodes whose ids are in `dropped` (the ones that
    made outputs from sources), each source in `renamed` called by its output's name wherever
    it is made or read, and no value_info left under the sources' old names."""
    nodes = [node for node in graph.node if id(node) not in dropped]
    for node in nodes:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [value for value in graph.value_info if value.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def unreshaped(model: onnx.ModelProto) -> set[str]:
    """The outputs of `model` that `unreshaped_outputs` returns before their Reshape."""
    return {name for entry in model.metadata_props if entry.key == UNRESHAPED_OUTPUTS
            for name in entry.value.split(",")}


def final_outputs(model: onnx.ModelProto) -> set[str]:
    """The outputs of the whole backward `model` that no node reads."""
    read = {name for node in model.graph.node for name in node_inputs(node)}
    return {value.name for value in model.graph.output if value.name not in read}
