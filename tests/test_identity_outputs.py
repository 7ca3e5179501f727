"""A graph output that an Identity copies is made by its source (capture/identity_outputs.py)."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import run_onnx_as_written, trained_small_bert
from onnx import TensorProto, helper

import lazygrad
from lazygrad.capture.identity_outputs import made_by_their_source


def _heads(expand_to: list[int], expand_read_elsewhere: bool) -> onnx.ModelProto:
    """kept = Identity(Expand(Transpose(a), expand_to)), y = Transpose(a) @ b (or the Expand's
    result @ b): attention's heads made contiguous and kept for the backward."""
    reader = "e" if expand_read_elsewhere else "t"
    nodes = [
        helper.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Constant", [], ["shape"], value=helper.make_tensor(
            "shape", TensorProto.INT64, [len(expand_to)], expand_to)),
        helper.make_node("Expand", ["t", "shape"], ["e"]),
        helper.make_node("Identity", ["e"], ["kept"]),
        helper.make_node("MatMul", [reader, "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 5]),
         helper.make_tensor_value_info("kept", TensorProto.FLOAT, expand_to)],
        value_info=[helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 4, 3]),
                    helper.make_tensor_value_info("e", TensorProto.FLOAT, expand_to)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_transpose_makes_the_output_through_an_expand_to_its_own_shape():
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal([2, 3, 4], dtype=np.float32),
             "b": rng.standard_normal([3, 5], dtype=np.float32)}
    for expand_read_elsewhere in (False, True):
        model = _heads([2, 4, 3], expand_read_elsewhere)
        expected = run_onnx_as_written(model, feeds)
        peeled = made_by_their_source(model)
        onnx.checker.check_model(peeled, full_check=True)
        made_by = {output: node.op_type for node in peeled.graph.node for output in node.output}
        assert made_by["kept"] == "Transpose" and "Identity" not in made_by.values()
        # The Expand stays only where another node reads it (ORT drops it there as a no-op).
        assert ("Expand" in made_by.values()) == expand_read_elsewhere
        for got, want in zip(run_onnx_as_written(peeled, feeds), expected):
            np.testing.assert_array_equal(got, want)


def test_a_broadcasting_expand_makes_the_output_and_an_output_source_keeps_its_copy():
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal([2, 3, 4], dtype=np.float32),
             "b": rng.standard_normal([3, 5], dtype=np.float32)}
    broadcast = _heads([3, 2, 4, 3], expand_read_elsewhere=False)
    expected = run_onnx_as_written(broadcast, feeds)
    peeled = made_by_their_source(broadcast)
    made_by = {output: node.op_type for node in peeled.graph.node for output in node.output}
    assert made_by["kept"] == "Expand" and "Identity" not in made_by.values()
    for got, want in zip(run_onnx_as_written(peeled, feeds), expected):
        np.testing.assert_array_equal(got, want)
    model = _heads([2, 4, 3], expand_read_elsewhere=False)
    model.graph.output.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 4, 3]))
    kept = made_by_their_source(model)
    assert "Identity" in [n.op_type for n in kept.graph.node]  # two outputs, two buffers


def test_attentions_kept_heads_are_no_copies_and_train_like_eager():
    lazy, entry = trained_small_bert(3)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits >= 2
    forward = entry.pair.graphs.forward.graph
    made_by = {output: node.op_type for node in forward.node for output in node.output}
    kept = [made_by.get(value.name) for value in forward.output]
    assert "Identity" not in kept and kept.count("Transpose") >= 3 * 2  # 3 per layer, 2 layers
