"""The constants of an exported ONNX graph, for the rewrites that look for one (gelu.py,
zero_where.py: scalars; scattered_outputs.py: a shape).

The exporter writes a scalar as an initializer, a Constant node (of a tensor, or of a number:
`value_int`, `value_float`, as lazygrad's own translations write some), or a Cast of either
(torchlib's `scalar_tensor` of a dtype): all are read here, by value, element type and rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

# A Constant's attributes that hold one number, and the element type of the scalar it makes.
_NUMBERS = {"value_int": onnx.TensorProto.INT64, "value_float": onnx.TensorProto.FLOAT}


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A one-element constant: its value, element type and rank."""

    value: float
    data_type: int  # onnx.TensorProto's code
    rank: int  # 0, or the dimensions of size 1 a broadcast against it adds


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Value name -> the tensor it holds, for the graph's initializers and Constant nodes."""
    tensors = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            number = next((a for a in node.attribute if a.name in _NUMBERS), None)
            if value is None and number is not None:
                value = onnx.helper.make_tensor(
                    "", _NUMBERS[number.name], [], [onnx.helper.get_attribute_value(number)])
            if value is not None:
                tensors[node.output[0]] = value
    return tensors


def scalar_constants(graph: onnx.GraphProto) -> dict[str, Scalar]:
    """Value name -> the one-element tensor it holds, for the graph's initializers, Constant
    nodes, and Casts of those."""
    tensors = constant_tensors(graph)
    found = {
        name: Scalar(float(onnx.numpy_helper.to_array(tensor).reshape(())), tensor.data_type,
                     len(tensor.dims))
        for name, tensor in tensors.items() if int(np.prod(tensor.dims)) == 1
        and tensor.data_type not in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED)
    }
    for node in graph.node:  # in graph order: a Cast follows what it reads
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.input[0] in found:
            to = next(a for a in node.attribute if a.name == "to")
            found[node.output[0]] = dataclasses.replace(
                found[node.input[0]], data_type=onnx.helper.get_attribute_value(to))
    return found
