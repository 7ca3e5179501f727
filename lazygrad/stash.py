"""What the forward keeps for the backward, as graphs: the stashing forward and the recompute.

Pure functions over the exported forward graph; which tensors to stash is the runtime's decision
(`Runtime.plan_stash`), making the graphs that produce them is this module's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx

from lazygrad import onnx_graph
from lazygrad.export import ExportedGraph

if TYPE_CHECKING:
    from lazygrad.runtime import SignatureEntry


def readable_by_backward(policy: str, exported: ExportedGraph, random: set[str]) -> set[str]:
    """Forward tensors a backward graph may read; it recomputes any other it needs.

    "recompute" keeps only the inputs and the random draws (a replayed Dropout would draw a new
    mask); the other policies let the backward read every forward tensor, so it recomputes none.
    """
    inputs = set(exported.graph_inputs)
    if policy == "recompute":
        return inputs | random
    return onnx_graph.produced_names(exported.model.graph.node) | inputs


def forward_graph(entry: SignatureEntry, stash: tuple[str, ...]) -> onnx.ModelProto:
    """The forward graph, also returning the stashed tensors it does not return already."""
    model = onnx_graph.without_optional_outputs(entry.exported.model, set(stash))
    returned = set(entry.exported.graph_outputs)
    outputs = list(model.graph.output) + [
        onnx_graph.value_info(name, entry.types[name]) for name in stash if name not in returned
    ]
    shapes = [entry.hoisted[name] for name in stash if name in entry.hoisted]
    return onnx_graph.make_model(
        model, [*model.graph.node, *shapes], list(model.graph.input), outputs,
        list(model.graph.initializer), "lazygrad_forward",
    )


def recompute_graph(
    entry: SignatureEntry, stash: tuple[str, ...], missing: tuple[str, ...]
) -> onnx.ModelProto:
    """The forward nodes that make `missing` from the graph inputs and the stashed tensors."""
    model = entry.exported.model
    have = set(entry.exported.graph_inputs) | set(stash)
    every = [*model.graph.node, *entry.hoisted.values()]  # hoisted shapes read forward tensors
    nodes = onnx_graph.slice_nodes(every, missing, have)
    reads = sorted((onnx_graph.consumed_names(nodes) - onnx_graph.produced_names(nodes)) & have)
    return onnx_graph.make_model(
        model,
        nodes,
        [onnx_graph.value_info(name, entry.types[name]) for name in reads],
        [onnx_graph.value_info(name, entry.types[name]) for name in missing],
        list(model.graph.initializer),
        "lazygrad_recompute",
    )
