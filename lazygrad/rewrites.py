"""Rewrites of the exported forward graph into ops that ORT runs and differentiates better.

SoftmaxCrossEntropyLoss -> LogSoftmax, GatherElements and a (masked) mean. Measured on 1024 x
8000 logits: forward + gradient 143 ms fused against 100 ms decomposed (PyTorch: 61 ms), and the
fused CPU kernel holds two logits-sized temporaries during the forward where the decomposition
holds one (the log-probabilities, which its backward reads, as the fused gradient reads log_prob).
Only forward ops are written here: ORT's gradient builder differentiates the result.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from lazygrad.onnx_graph import elem_type, tensor_types


def decompose_cross_entropy(model: onnx.ModelProto) -> onnx.ModelProto:
    """Copy of `model` with each plain SoftmaxCrossEntropyLoss over (N, C) logits decomposed.

    Left as they are: class weights, a log_prob output someone reads, logits of another rank.
    """
    types = tensor_types(model)
    consumed = {name for node in model.graph.node for name in node.input}
    consumed |= {out.name for out in model.graph.output}
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(model.graph.node):
        if _decomposable(node, types, consumed):
            nodes.extend(_decomposed(node, types, f"lazygrad_ce_{index}"))
        else:
            nodes.append(node)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    return rewritten


def _decomposable(
    node: onnx.NodeProto, types: dict[str, onnx.TypeProto], consumed: set[str]
) -> bool:
    if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
        return False
    logits = types.get(node.input[0])
    return (
        len(node.input) == 2
        and not (len(node.output) > 1 and node.output[1] in consumed)
        and logits is not None
        and len(logits.tensor_type.shape.dim) == 2
    )


def _decomposed(
    node: onnx.NodeProto, types: dict[str, onnx.TypeProto], prefix: str
) -> list[onnx.NodeProto]:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attributes.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore_index = attributes.get("ignore_index")
    logits, labels = node.input[0], node.input[1]
    float_type = elem_type(types[logits])

    def name(suffix: str) -> str:
        return f"{prefix}/{suffix}"

    def constant(suffix: str, data_type: int, values: list, dims: list[int]) -> onnx.NodeProto:
        tensor = helper.make_tensor(name(suffix), data_type, dims, values)
        return helper.make_node("Constant", [], [name(suffix)], value=tensor)

    out = [
        helper.make_node("LogSoftmax", [logits], [name("log_prob")], axis=1),
        helper.make_node("Cast", [labels], [name("labels")], to=TensorProto.INT64),
        constant("axis", TensorProto.INT64, [1], [1]),
    ]
    index = name("labels")
    if ignore_index is not None:
        out += [
            constant("ignore", TensorProto.INT64, [ignore_index], []),
            constant("zero", TensorProto.INT64, [0], []),
            helper.make_node("Equal", [name("labels"), name("ignore")], [name("ignored")]),
            helper.make_node(
                "Where", [name("ignored"), name("zero"), name("labels")], [name("safe")]
            ),
            helper.make_node("Not", [name("ignored")], [name("kept")]),
            helper.make_node("Cast", [name("kept")], [name("weight")], to=float_type),
        ]
        index = name("safe")
    out += [
        helper.make_node("Unsqueeze", [index, name("axis")], [name("index")]),
        helper.make_node(
            "GatherElements", [name("log_prob"), name("index")], [name("picked")], axis=1
        ),
        helper.make_node("Squeeze", [name("picked"), name("axis")], [name("picked_1d")]),
    ]
    picked = name("picked_1d")
    if ignore_index is not None:
        out.append(helper.make_node("Mul", [picked, name("weight")], [name("masked")]))
        picked = name("masked")
    loss = node.output[0]
    if reduction == "none":
        out.append(helper.make_node("Neg", [picked], [loss]))
    elif reduction == "sum":
        out += [
            helper.make_node("ReduceSum", [picked], [name("sum")], keepdims=0),
            helper.make_node("Neg", [name("sum")], [loss]),
        ]
    elif ignore_index is not None:  # mean over the labels that count, as PyTorch does
        out += [
            helper.make_node("ReduceSum", [picked], [name("sum")], keepdims=0),
            helper.make_node("ReduceSum", [name("weight")], [name("count")], keepdims=0),
            helper.make_node("Div", [name("sum"), name("count")], [name("mean")]),
            helper.make_node("Neg", [name("mean")], [loss]),
        ]
    else:
        out += [
            helper.make_node("ReduceMean", [picked], [name("mean")], keepdims=0),
            helper.make_node("Neg", [name("mean")], [loss]),
        ]
    return out
