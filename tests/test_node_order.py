"""The backward as ORT is to run it: transposed matmuls fused in place, functions inlined, and
the backward's sessions running ready nodes in the graph's node order."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
from conftest import run_onnx_as_written, trained_small_bert
from onnx import TensorProto, helper

import lazygrad
from lazygrad.capture import node_order


def _matmuls(perm_a: list[int], extra_reader: bool) -> onnx.ModelProto:
    """y = Transpose(a, perm_a) @ b (and, with `extra_reader`, t = the transpose as an output)."""
    shape_a = [2, 5, 3] if len(perm_a) == 3 else [5, 3]
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=perm_a),
        helper.make_node("MatMul", ["at", "b"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("at", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, shape_a),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [5, 4])],
        outputs,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _swaps_last_two(node: onnx.NodeProto | None) -> bool:
    if node is None or node.op_type != "Transpose":
        return False
    perm = list(node.attribute[0].ints)
    return perm == [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2]


def test_a_matmul_of_a_last_two_dimensions_transpose_becomes_a_fused_matmul_in_its_place():
    rng = np.random.default_rng(0)
    for perm in ([1, 0], [0, 2, 1]):
        model = _matmuls(perm, extra_reader=False)
        a = rng.standard_normal([5, 3] if len(perm) == 2 else [2, 5, 3], dtype=np.float32)
        b = rng.standard_normal([5, 4], dtype=np.float32)
        (expected,) = run_onnx_as_written(model, {"a": a, "b": b})
        fused = node_order.fuse_transposed_matmuls(model)
        assert [n.op_type for n in fused.graph.node] == ["FusedMatMul"]  # the Transpose dropped
        attributes = {a.name: a.i for a in fused.graph.node[0].attribute if a.name != "alpha"}
        assert attributes == {"transA": 1, "transB": 0}
        (got,) = run_onnx_as_written(fused, {"a": a, "b": b})
        np.testing.assert_array_equal(got, expected)


def test_a_transpose_read_elsewhere_stays_and_other_permutations_are_left_alone():
    kept = node_order.fuse_transposed_matmuls(_matmuls([1, 0], extra_reader=True))
    assert [n.op_type for n in kept.graph.node] == ["Transpose", "FusedMatMul"]
    other = node_order.fuse_transposed_matmuls(_matmuls([1, 0, 2], extra_reader=False))
    assert [n.op_type for n in other.graph.node] == ["Transpose", "MatMul"]


def test_the_backward_runs_in_node_order_without_function_calls_and_trains_like_eager():
    lazy, entry = trained_small_bert(2)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 1
    graphs = entry.pair.graphs
    for model in (graphs.backward, *graphs.backward_segments):
        assert not model.functions
        made_by = {output: node for node in model.graph.node for output in node.output}
        fused = [n for n in model.graph.node if n.op_type == "FusedMatMul"]
        assert fused  # the weight gradients' matmuls of transposed activations
        for node in model.graph.node:
            if node.op_type == "MatMul":
                assert not any(_swaps_last_two(made_by.get(name)) for name in node.input)
    orders = {
        which: session._session.get_session_options().execution_order
        for (which, _, _), session in entry.pair._sessions.items()
    }
    assert orders["forward"] == onnxruntime.ExecutionOrder.DEFAULT
    assert orders["backward"] == onnxruntime.ExecutionOrder.PRIORITY_BASED
