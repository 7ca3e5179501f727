"""A selection of zeros (ReLU's backward) runs on ORT's CPU as a product by the mask, checked:
eager's values, infinite and NaN gradients included."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from conftest import assert_close, assert_grads_equal, ran_through_ort
from onnx import TensorProto, helper

import lazygrad
from lazygrad import attach
from lazygrad.capture import zero_where

SHAPE = [4, 16, 32, 32]  # above zero_where.SMALLEST


def _selection(zero_first: bool, shape: list[int] = SHAPE, fill: float = 0.0) -> onnx.ModelProto:
    """y = Where(x <= 0, fill, g) (or Where(x > 0, g, fill)), the fill a Cast of a scalar
    constant as torchlib writes threshold_backward's zero."""
    zero = [helper.make_node("Constant", [], ["zero_double"],
                             value=helper.make_tensor("z", TensorProto.DOUBLE, [], [fill])),
            helper.make_node("Cast", ["zero_double"], ["zero"], to=TensorProto.FLOAT)]
    compare = "LessOrEqual" if zero_first else "Greater"
    operands = ["mask", "zero", "g"] if zero_first else ["mask", "g", "zero"]
    nodes = [*zero, helper.make_node("Constant", [], ["origin"], value=helper.make_tensor(
                 "o", TensorProto.FLOAT, [], [0.0])),
             helper.make_node(compare, ["x", "origin"], ["mask"]),
             helper.make_node("Where", operands, ["y"], name="select")]
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name in "xg"]
    graph = helper.make_graph(nodes, "g", values,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _run(model: onnx.ModelProto, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "g": g})[0]


@pytest.mark.parametrize("zero_first", [True, False])
def test_a_selection_of_zeros_is_the_product_and_falls_back_to_the_where_on_infinities(zero_first):
    model = _selection(zero_first)
    rewritten = zero_where.zeros_selected_by_products(model)
    assert [n.op_type for n in rewritten.graph.node].count("Where") == 0
    assert [n.op_type for n in rewritten.graph.node].count("If") == 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    g = rng.standard_normal(SHAPE, dtype=np.float32)
    masked = x <= 0
    for where_masked in (None, np.inf, -np.inf, np.nan):  # a non-finite g where masked
        values = g.copy()
        if where_masked is not None:
            values[np.unravel_index(np.flatnonzero(masked)[:3], SHAPE)] = where_masked
        expected = np.where(masked, 0.0, values).astype(np.float32)
        got = _run(rewritten, x, values)
        np.testing.assert_array_equal(got, expected)  # -0 == 0: equal to the sign of a zero
        assert not np.isnan(got).any()
    nan_kept = g.copy()  # a NaN where the mask keeps g stays a NaN, as eager's
    nan_kept[np.unravel_index(np.flatnonzero(~masked)[0], SHAPE)] = np.nan
    np.testing.assert_array_equal(_run(rewritten, x, nan_kept),
                                  np.where(masked, 0.0, nan_kept).astype(np.float32))


def test_small_selections_and_selections_of_other_values_stay_where_nodes():
    for left in (_selection(True, [4, 8]), _selection(True, fill=1.0)):
        assert zero_where.zeros_selected_by_products(left) is left


class ReluNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1, bias=False)  # BatchNorm follows
        self.bn = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Conv2d(16, 4, 1)

    def forward(self, x):
        hidden = torch.relu(self.bn(self.conv(x)))
        return self.head(hidden), hidden


def test_relu_networks_backward_runs_as_products_with_eagers_gradients_infinities_included():
    """The ReLU's input gradient is a selection of zeros (16 x 16 x 16 x 16 elements): through
    ORT it is the checked product, and a cotangent that is infinite where the ReLU cut its
    input gives eager's finite gradients, not NaN."""
    torch.manual_seed(0)
    eager = ReluNet()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(16, 3, 16, 16)
    for step in range(4):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(x), eager(x)
        for index, (a, b) in enumerate(zip(got, want)):
            assert_close(a.detach(), b.detach(), f"step {step} output {index}")
        cotangent = torch.randn_like(want[1])
        if step >= 2:  # infinite where the ReLU gave 0: its selection drops them
            cotangent = torch.where(want[1] == 0, torch.inf, cotangent)
        for out in (got, want):
            (out[0].sum() + (out[1] * cotangent).sum()).backward()
        assert_grads_equal(lazy, eager, f"step {step}")
        assert all(p.grad.isfinite().all() for p in lazy.parameters())
        assert step == 0 or ran_through_ort(list(got))
    assert lazygrad.stats(lazy).fallbacks == 0
    (entry,) = attach.installed(lazy)._pairs.values()
    backward = entry.pair.session("backward", torch.device("cpu"))
    kinds = [n.op_type for n in onnx.load_from_string(backward._model_bytes).graph.node]
    assert "If" in kinds and "Where" not in kinds
