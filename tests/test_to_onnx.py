"""The exported ONNX graph's tidying (capture/to_onnx.py), on graphs made by hand."""

from __future__ import annotations

import numpy as np
import onnxruntime
from onnx import TensorProto, helper

from lazygrad.capture import to_onnx


def _run(graph, **inputs: np.ndarray) -> list[np.ndarray]:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def test_identity_transposes_are_dropped_and_their_readers_read_their_input():
    """torchlib's `index_put` on the leading dimension moves it first and back with identity
    Transposes, which ORT runs as copies. Readers in the graph and in an If's branch read the
    input instead; a graph output keeps its Transpose, and a real permutation stays."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    branch_out = helper.make_tensor_value_info("branch", TensorProto.FLOAT, [2, 3])
    then_branch = helper.make_graph([helper.make_node("Neg", ["same"], ["branch"])], "then", [],
                                    [branch_out])
    else_branch = helper.make_graph([helper.make_node("Abs", ["same"], ["branch"])], "else", [],
                                    [branch_out])
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["same"], perm=[0, 1]),
            helper.make_node("Transpose", ["same"], ["same_again"], perm=[0, 1]),
            helper.make_node("Add", ["same_again", "x"], ["twice"]),
            helper.make_node("If", ["flag"], ["chosen"], then_branch=then_branch,
                             else_branch=else_branch),
            helper.make_node("Transpose", ["x"], ["flipped"], perm=[1, 0]),
            helper.make_node("Transpose", ["x"], ["kept"], perm=[0, 1]),
        ],
        "g",
        [x, flag],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
         for name in ("twice", "chosen", "flipped", "kept")],
    )
    value = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    expected = [_run(graph, x=value, flag=np.array(b)) for b in (True, False)]
    to_onnx._identity_transposes_dropped(graph)
    perms = [list(node.attribute[0].ints) for node in graph.node if node.op_type == "Transpose"]
    assert sorted(perms) == [[0, 1], [1, 0]]  # the output's and the permutation
    for b, before in zip((True, False), expected, strict=True):
        for got, want in zip(_run(graph, x=value, flag=np.array(b)), before, strict=True):
            np.testing.assert_array_equal(got, want)
