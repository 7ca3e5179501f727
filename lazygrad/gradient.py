"""Stage 2: forward graph + grad mask -> a backward graph for exactly that mask.

ORT's `GradientGraphBuilder` differentiates the masked outputs with respect to the inputs that
can reach them; the result (forward + gradient nodes in one model) is then split so that the
backward graph reads only the forward tensors it needs. Which forward tensors count as "already
there" (`available`) is the caller's choice: every forward tensor (stash what is read) or only the
graph inputs and random draws (recompute the rest inside the backward graph).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import onnx
import onnxruntime
from onnxruntime.capi import _pybind_state as ort_c

from lazygrad import onnx_graph
from lazygrad.onnx_graph import FLOAT_TYPES, elem_type

SHAPE_OPS = frozenset({"Shape", "Size"})
OUTPUT_SUFFIX = "__out"
GRAD_SUFFIX = "_grad"


class GradientError(RuntimeError):
    """ORT cannot differentiate this graph (the runtime falls back to eager)."""


@dataclasses.dataclass
class BackwardGraph:
    """A runnable backward graph and the names it reads and writes."""

    model: onnx.ModelProto
    grad_of: list[str]  # forward outputs whose gradients it reads, in graph-output order
    reads: list[str]  # forward tensors it reads: graph inputs and stashed intermediates
    grads_for: list[str]  # graph inputs whose gradients it returns
    build_seconds: float
    # Shape/Size nodes of the gradient moved into the forward: the backward reads their small
    # outputs instead of the whole forward tensors they measure.
    forward_nodes: list[onnx.NodeProto] = dataclasses.field(default_factory=list)

    @property
    def grad_input_names(self) -> list[str]:
        return [name + OUTPUT_SUFFIX + GRAD_SUFFIX for name in self.grad_of]

    @property
    def grad_output_names(self) -> list[str]:
        return [name + GRAD_SUFFIX for name in self.grads_for]


def differentiable_outputs(
    model: onnx.ModelProto, trainable: Iterable[str], types: dict[str, onnx.TypeProto]
) -> list[str]:
    """Graph outputs a gradient can flow back from to at least one trainable input."""
    reach = onnx_graph.differentiable_reach(list(model.graph.node), trainable, types)
    return [out.name for out in model.graph.output if out.name in reach]


def trainable_ancestors(
    model: onnx.ModelProto, outputs: Iterable[str], types: dict[str, onnx.TypeProto]
) -> set[str]:
    """Float tensors from which a gradient path leads to `outputs`."""
    ancestors = {name for name in outputs}
    for node in reversed(model.graph.node):
        if any(out in ancestors for out in node.output if out):
            ancestors.update(
                name for name in node.input
                if name and name in types and elem_type(types[name]) in FLOAT_TYPES
            )
    return ancestors


def build_backward(
    forward: onnx.ModelProto,
    outputs: list[str],
    trainable: list[str],
    available: set[str],
    types: dict[str, onnx.TypeProto],
) -> BackwardGraph:
    """Backward graph of `outputs` with respect to the `trainable` inputs that reach them.

    `available` names the forward tensors the backward graph may read; any other forward tensor
    it needs is recomputed inside it from those.
    """
    started = time.perf_counter()
    ancestors = trainable_ancestors(forward, outputs, types)
    wrt = [name for name in trainable if name in ancestors]
    if not wrt:
        raise GradientError(f"no trainable input reaches outputs {outputs}")
    built = _run_builder(_with_output_identities(forward, outputs), outputs, wrt)
    model, hoisted = _split(forward, built, outputs, wrt, available, types)
    reads = sorted(
        {value.name for value in model.graph.input}
        - {name + OUTPUT_SUFFIX + GRAD_SUFFIX for name in outputs}
    )
    seconds = time.perf_counter() - started
    return BackwardGraph(model, list(outputs), reads, wrt, seconds, forward_nodes=hoisted)


def hoisted_type(node: onnx.NodeProto) -> onnx.TypeProto:
    """Type of a hoisted Shape (1-D int64) or Size (int64 scalar) output."""
    dims = [None] if node.op_type == "Shape" else []
    return onnx.helper.make_tensor_type_proto(onnx.TensorProto.INT64, dims)


def _with_output_identities(forward: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """Route each differentiated output through `Identity -> name__out`.

    Measured fix: when an output also feeds another output, the builder's internally computed
    gradient of it silently overwrites the external one; through the Identity the builder sums
    both contributions itself.
    """
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    del model.graph.output[:]
    for name in outputs:
        model.graph.node.append(
            onnx.helper.make_node("Identity", [name], [name + OUTPUT_SUFFIX])
        )
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name + OUTPUT_SUFFIX))
    return model


def _run_builder(
    model: onnx.ModelProto, outputs: list[str], wrt: list[str]
) -> onnx.ModelProto:
    y_names = {name + OUTPUT_SUFFIX for name in outputs}
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # without it the builder logs every graph transformer
    try:
        builder = ort_c.GradientGraphBuilder(
            model.SerializeToString(), y_names, set(wrt), "", options
        )
        builder.build()
        return onnx.load_from_string(builder.get_model())
    except Exception as error:  # ORT raises its own Fail/RuntimeException types
        raise GradientError(
            f"onnxruntime-training cannot build the gradient: {type(error).__name__}: {error}"
        ) from error


def _split(
    forward: onnx.ModelProto,
    built: onnx.ModelProto,
    outputs: list[str],
    wrt: list[str],
    available: set[str],
    types: dict[str, onnx.TypeProto],
) -> tuple[onnx.ModelProto, list[onnx.NodeProto]]:
    """Keep the nodes that compute the wanted gradients from `available` forward tensors."""
    grad_inputs = {name + OUTPUT_SUFFIX + GRAD_SUFFIX: types[name] for name in outputs}
    grad_outputs = [name + GRAD_SUFFIX for name in wrt]
    nodes = list(built.graph.node)
    constant_made = {out for node in nodes if not node.input for out in node.output}
    kept = onnx_graph.slice_nodes(
        nodes, grad_outputs, (available - constant_made) | set(grad_inputs)
    )
    initializers = {init.name: init for init in built.graph.initializer}
    graph_inputs = {value.name for value in forward.graph.input}
    forward_tensors = onnx_graph.produced_names(forward.graph.node) | graph_inputs
    # ORT's gradients of broadcasting ops take the Shape of whole forward tensors (the logits
    # before their bias, say); measured in the forward, only the shape needs stashing.
    hoisted = [
        node for node in kept
        if node.op_type in SHAPE_OPS and node.domain in ("", "ai.onnx")
        and node.input[0] in available and node.input[0] not in graph_inputs
    ]
    kept = [node for node in kept if node not in hoisted]
    types = {**types, **{node.output[0]: hoisted_type(node) for node in hoisted}}
    forward_tensors |= {node.output[0] for node in hoisted}
    read = onnx_graph.consumed_names(kept) - onnx_graph.produced_names(kept)
    missing = read - forward_tensors - set(grad_inputs) - set(initializers)
    if missing:
        raise GradientError(
            f"the gradient reads tensors the forward graph does not produce: {sorted(missing)}"
        )
    inputs = [
        onnx_graph.value_info(name, grad_inputs[name] if name in grad_inputs else types[name])
        for name in sorted(read - set(initializers))
    ]
    outs = [onnx_graph.value_info(name + GRAD_SUFFIX, types[name]) for name in wrt]
    model = onnx_graph.make_model(
        built, kept, inputs, outs, [initializers[n] for n in sorted(read & set(initializers))],
        "lazygrad_backward",
    )
    return model, hoisted
