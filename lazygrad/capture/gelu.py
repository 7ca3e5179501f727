"""GELU as one ORT kernel: the exporter's five-node erf GELU made the Gelu contrib op, in place.

torchlib translates `aten.gelu` (approximate="none") as x * (0.5 * (1 + erf(x / sqrt(2)))):
Div, Erf, Add, Mul, Mul, five passes over the feed-forward's widest tensor. ORT fuses that
formula into its Gelu kernel only when the 0.5 multiplies x, not the bracket, so on the
exporter's form every pass runs (on the 8-layer model of benchmarks/memory.py, 40 ms of a 1 s
step against eager's 9 ms for its gelu). The fused node computes the same formula in one pass;
only the forward's formula is replaced: the backward's derivative stays the one PyTorch's
gelu_backward traced.
"""

from __future__ import annotations

import math

import onnx
import onnx.helper

from lazygrad.capture.node_order import ORT_DOMAIN, import_ort_domain, is_standard, node_inputs
from lazygrad.capture.onnx_constants import scalar_constants


def fuse_erf_gelu(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place) with each x * (0.5 * (1 + erf(x / sqrt(2)))) a Gelu node in
    the outer Mul's place; the pattern's inner nodes and constants are dropped where nothing else
    reads them."""
    graph = model.graph
    made_by = {output: node for node in graph.node for output in node.output}
    # float32 only: the formula's constants have x's type, and ORT's CPU Gelu kernel is
    # float32's alone.
    constants = {name: scalar.value for name, scalar in scalar_constants(graph).items()
                 if scalar.data_type == onnx.TensorProto.FLOAT}
    nodes, inner = [], set()
    for node in graph.node:
        matched = _erf_gelu(node, made_by, constants)
        if matched is not None:
            x, parts = matched
            node = onnx.helper.make_node("Gelu", [x], list(node.output), name=node.name,
                                         domain=ORT_DOMAIN)
            inner.update(id(part) for part in parts)
        nodes.append(node)
    if not inner:
        return model
    while True:  # inner nodes and constants whose outputs nothing reads, innermost last
        read = {name for node in nodes for name in node_inputs(node)}
        read.update(value.name for value in graph.output)
        kept = [n for n in nodes if not (id(n) in inner or n.op_type == "Constant")
                or any(o in read for o in n.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    del graph.node[:]
    graph.node.extend(nodes)
    import_ort_domain(model)
    return model


def _erf_gelu(node: onnx.NodeProto, made_by: dict[str, onnx.NodeProto],
              constants: dict[str, float]) -> tuple[str, list[onnx.NodeProto]] | None:
    """(x, the pattern's inner nodes) when `node` is the outer Mul of the exporter's GELU."""
    if not is_standard(node, "Mul"):
        return None
    for x, bracket in (node.input, reversed(node.input)):
        half = made_by.get(bracket)
        one_plus = _operand(half, "Mul", 0.5, made_by, constants)
        erf = _operand(one_plus, "Add", 1.0, made_by, constants)
        if not is_standard(erf, "Erf"):
            continue
        scaled = made_by.get(erf.input[0])
        if is_standard(scaled, "Div") and scaled.input[0] == x \
                and _near(constants.get(scaled.input[1]), math.sqrt(2.0)):
            return x, [half, one_plus, erf, scaled]
    return None


def _operand(node: onnx.NodeProto | None, op_type: str, constant: float,
             made_by: dict[str, onnx.NodeProto], constants: dict[str, float]
             ) -> onnx.NodeProto | None:
    """The node making the other operand of `node`, an `op_type` with the scalar `constant`."""
    if not is_standard(node, op_type):
        return None
    for this, other in (node.input, reversed(node.input)):
        if _near(constants.get(this), constant):
            return made_by.get(other)
    return None


def _near(value: float | None, wanted: float) -> bool:
    return value is not None and abs(value - wanted) <= 1e-6 * wanted
