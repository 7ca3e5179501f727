"""The exporter's erf GELU made ORT's one-pass Gelu kernel, and nothing else changed."""

from __future__ import annotations

import copy
import math

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from conftest import assert_loss_step_like_eager
from onnx import TensorProto, helper

import lazygrad
from lazygrad import attach
from lazygrad.capture import gelu


def _erf_gelu(sqrt2: float = math.sqrt(2.0), half: float = 0.5, extra_reader: bool = False
              ) -> onnx.ModelProto:
    """y = x * (half * (1 + erf(x / sqrt2))), as torchlib translates aten.gelu (and, with
    `extra_reader`, the erf as an output too)."""
    constants = [helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TensorProto.FLOAT, [], [value])) for name, value in
        (("c_sqrt2", sqrt2), ("c_one", 1.0), ("c_half", half))]
    nodes = [
        *constants,
        helper.make_node("Div", ["x", "c_sqrt2"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "c_one"], ["one_plus"]),
        helper.make_node("Mul", ["c_half", "one_plus"], ["bracket"]),
        helper.make_node("Mul", ["x", "bracket"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("erf", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_the_exporters_erf_gelu_becomes_one_gelu_node_with_the_same_values():
    x = np.random.default_rng(0).standard_normal([4, 6], dtype=np.float32) * 3
    model = _erf_gelu()
    (expected,) = _run(model, x)
    fused = gelu.fuse_erf_gelu(model)
    assert [n.op_type for n in fused.graph.node] == ["Gelu"]
    assert fused.graph.node[0].domain == "com.microsoft"
    (got,) = _run(fused, x)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_pattern_read_elsewhere_keeps_that_node_and_other_constants_are_left_alone():
    x = np.random.default_rng(1).standard_normal([4, 6], dtype=np.float32)
    shared = gelu.fuse_erf_gelu(_erf_gelu(extra_reader=True))
    types = [n.op_type for n in shared.graph.node if n.op_type != "Constant"]
    assert sorted(types) == ["Div", "Erf", "Gelu"]  # the erf is an output: it stays
    np.testing.assert_allclose(_run(shared, x)[0], _run(_erf_gelu(), x)[0], rtol=1e-6, atol=1e-6)
    for other in (_erf_gelu(sqrt2=1.5), _erf_gelu(half=0.25)):
        assert not any(n.op_type == "Gelu" for n in gelu.fuse_erf_gelu(other).graph.node)


class GeluMLP(torch.nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32),
                                       torch.nn.GELU(approximate=approximate),
                                       torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.net(x)
        return y.square().mean(), y


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_gelu_model_trains_like_eager_with_one_gelu_node_for_the_erf_form(approximate):
    torch.manual_seed(0)
    eager = GeluMLP(approximate)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(5, 8) * 3
    for step in range(3):
        assert_loss_step_like_eager(lazy, eager, (x,), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2
    (entry,) = attach.installed(lazy)._pairs.values()
    types = {n.op_type for n in entry.pair.graphs.forward.graph.node}
    assert ("Gelu" in types and "Erf" not in types) == (approximate == "none"), types
