"""A selection of zeros, Where(c, 0, g), as g times the mask on ORT's CPU, checked.

ReLU's backward is one (`threshold_backward`: where(out <= 0, 0, grad)), and a masked fill of
zeros another. ORT's CPU Where kernel is slow: on a ResNet stem's [8, 64, 56, 56] gradient
8-10 ms a call against 1.0 ms for the same selection as a Cast of the mask and a Mul (ORT 1.32,
2 threads), and it was 9% of a ResNet-18 training step's kernel time through ORT
(`benchmarks.profile resnet18`), against 2% for eager's threshold_backward.

A product differs from the selection only where g is infinite or NaN (there inf * 0 is NaN
where the selection gives 0) and in the sign of a zero (-x * 0 is -0; the peephole rules are
exact to that too). So the product is checked: its sum is finite exactly when none of its
elements is infinite or NaN, and then every element is the selection's; otherwise an If runs
the Where itself. The check is one more pass, a reduction; the If's copy of its result one
more. Small selections are left as they are: the If's own cost would exceed the Where's.

CPU sessions only (graph_pair.py): CUDA's Where is fast, and an If's condition must be read on
the host, a synchronisation per selection.
"""

from __future__ import annotations

import math

import onnx
import onnx.helper

from lazygrad.capture.onnx_constants import scalar_constants

# Selections of fewer elements than this (as far as the static shape says) stay Where nodes.
SMALLEST = 1 << 15

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def zeros_selected_by_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each large Where(c, 0, g) or Where(c, g, 0) of float32 or float64
    made the checked product above; `model` itself when it has none."""
    graph = model.graph
    zeros = {name for name, scalar in scalar_constants(graph).items()
             if scalar.value == 0.0 and scalar.rank == 0 and scalar.data_type in _FLOATS}
    types = {value.name: value.type for value in [*graph.value_info, *graph.output]}
    if not any(_selects_zeros(node, zeros, types) for node in graph.node):
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        if _selects_zeros(node, zeros, types):
            nodes.extend(_checked_product(node, zeros, types[node.output[0]]))
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _selects_zeros(node: onnx.NodeProto, zeros: set[str], types: dict) -> bool:
    """Whether `node` is a Where between a scalar zero and a tensor, of SMALLEST elements or
    more."""
    if node.op_type != "Where" or node.domain not in ("", "ai.onnx"):
        return False
    _, picked, other = node.input
    if (picked in zeros) == (other in zeros):
        return False
    kind = types.get(node.output[0])
    if kind is None or not kind.HasField("tensor_type") or not kind.tensor_type.HasField("shape"):
        return False
    dims = kind.tensor_type.shape.dim
    # Symbolic dimensions count as 1: at least this many elements.
    return math.prod(d.dim_value if d.HasField("dim_value") else 1 for d in dims) >= SMALLEST


def _checked_product(node: onnx.NodeProto, zeros: set[str],
                     kind: onnx.TypeProto) -> list[onnx.NodeProto]:
    """The nodes that compute `node`'s output as the product, with the If that falls back to
    `node` itself."""
    condition, picked, other = node.input
    name = node.name or node.output[0]
    part = f"{name}__zero_where"
    # Where(c, g, 0) keeps g where c holds; Where(c, 0, g) where it does not.
    kept, values = (condition, picked) if other in zeros else (f"{part}_kept", other)
    made = []
    if kept != condition:
        made.append(onnx.helper.make_node("Not", [condition], [kept], name=f"{part}_not"))
    mask, product, total = f"{part}_mask", f"{part}_product", f"{part}_total"
    infinite, nan, unsure = f"{part}_infinite", f"{part}_nan", f"{part}_unsure"
    made += [
        onnx.helper.make_node("Cast", [kept], [mask], name=f"{part}_cast",
                              to=kind.tensor_type.elem_type),
        onnx.helper.make_node("Mul", [values, mask], [product], name=f"{part}_mul"),
        onnx.helper.make_node("ReduceSum", [product], [total], name=f"{part}_sum", keepdims=0),
        onnx.helper.make_node("IsInf", [total], [infinite], name=f"{part}_isinf"),
        onnx.helper.make_node("IsNaN", [total], [nan], name=f"{part}_isnan"),
        onnx.helper.make_node("Or", [infinite, nan], [unsure], name=f"{part}_or"),
    ]
    selected, passed = f"{part}_selected", f"{part}_passed"
    selection = onnx.helper.make_graph(
        [onnx.helper.make_node("Where", list(node.input), [selected], name=f"{part}_where")],
        f"{part}_selection", [], [onnx.helper.make_value_info(selected, kind)])
    products = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [product], [passed], name=f"{part}_identity")],
        f"{part}_products", [], [onnx.helper.make_value_info(passed, kind)])
    made.append(onnx.helper.make_node("If", [unsure], list(node.output), name=name,
                                      then_branch=selection, else_branch=products))
    return made
