"""Grouped matrix multiplication (the matmul of Mixture-of-Experts layers) through ONNX Runtime:
transformers' `grouped_mm_fallback` op and its backward, and `aten._grouped_mm` with offsets,
against eager on uneven groups, an empty group among them.

transformers' ops exist once transformers is imported (the `hf` extra): those tests skip
without it.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper

import lazygrad
from lazygrad.capture import stacked_io
from lazygrad.capture.trace import onnx_registry

aten = torch.ops.aten


def _transformers_ops() -> None:
    pytest.importorskip("transformers.integrations.moe")


class GroupedExperts(torch.nn.Module):
    """Rows sorted by expert, each expert's run of rows times its weight (as transformers'
    experts do under tracing), then a nonlinearity so gradients depend on the outputs."""

    def __init__(self, experts: int = 4, features: int = 8, out: int = 6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, features, out))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, offsets).tanh()


def test_grouped_mm_fallback_matches_eager_with_an_empty_group_and_new_offsets():
    """Each call's offsets are data: one graph serves every routing (no value is baked in),
    the empty expert's weight gradient is zero, rows past the last offset are zero, and
    outputs and gradients are eager's."""
    _transformers_ops()
    torch.manual_seed(0)
    model = GroupedExperts()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    x = torch.randn(12, 8)
    routings = [[3, 3, 9, 11], [0, 5, 12, 12], [4, 4, 4, 12], [3, 3, 9, 11]]  # an empty group each
    for step, ends in enumerate(routings):
        offsets = torch.tensor(ends, dtype=torch.int32)
        for m in (lazy, model):
            m.zero_grad(set_to_none=True)
        x_lazy, x_eager = (x.clone().requires_grad_() for _ in range(2))
        out, expected = lazy(x_lazy, offsets), model(x_eager, offsets)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        torch.testing.assert_close(x_lazy.grad, x_eager.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lazy.weight.grad, model.weight.grad, rtol=1e-4, atol=1e-5)
        empty = [g for g in range(4) if ends[g] == (ends[g - 1] if g else 0)]
        assert all(not lazy.weight.grad[g].any() for g in empty), step
        assert not out[ends[-1]:].any()
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0
    assert stats.builds == 1 and stats.hits == len(routings) - 1


class TransposedExperts(torch.nn.Module):
    """Each expert's weight stored (out, features) and handed to the op transposed, as
    transformers' Mixtral and OLMoE experts do (`weight.transpose(-2, -1)`)."""

    def __init__(self, experts: int = 4, features: int = 8, out: int = 6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, out, features))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weight = self.weight.transpose(-2, -1)
        return torch.ops.transformers.grouped_mm_fallback(x, weight, offsets).tanh()


def test_a_transposed_weights_gradient_is_stacked_in_its_layout_by_the_products():
    """The weight gradient's per-expert products compute their transposes (stacked_products):
    the backward holds no Transpose of the stack, and gradients are eager's."""
    _transformers_ops()
    torch.manual_seed(0)
    model = TransposedExperts()
    lazy = lazygrad.lazy(copy.deepcopy(model), wait_for_builds=True)
    x = torch.randn(12, 8)
    for ends in ([3, 3, 9, 11], [0, 5, 12, 12], [4, 4, 4, 12]):
        offsets = torch.tensor(ends, dtype=torch.int32)
        outputs = []
        for m in (model, lazy):
            m.zero_grad(set_to_none=True)
            outputs.append(m(x, offsets))
            outputs[-1].pow(2).sum().backward()
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lazy.weight.grad, model.weight.grad, rtol=1e-4, atol=1e-5)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits >= 1
    for entry in lazygrad.api.runtime_of(lazy)._pairs.values():
        backward = entry.pair.graphs.backward.graph
        made_by = {output: node.op_type for node in backward.node for output in node.output}
        assert not [n for n in backward.node
                    if n.op_type == "Transpose" and made_by.get(n.input[0]) == "Concat"]
        assert any(n.op_type == "FusedMatMul" for n in backward.node)


def _aten_grouped_mm_translation():
    (translation, *_) = onnx_registry().get_decomps(aten._grouped_mm.default)
    return translation.onnx_function


def _evaluate(function, *arrays: torch.Tensor) -> torch.Tensor:
    """Run the translation op by op on ONNX Runtime (onnxscript's eager evaluator)."""
    result = function(*(a.numpy() for a in arrays))
    return torch.from_numpy(np.asarray(result.value))


def test_aten_grouped_mm_translation_matches_eager_in_both_offset_forms():
    """`aten._grouped_mm` with offsets, the two forms an MoE layer and its backward use:
    (S, K) x (G, K, N) grouping rows, and (K, S) x (S, N) grouping the inner dimension (the
    weight gradient, as torch's own backward of the op computes it). torch's meta kernel
    accepts only bfloat16, which ORT's CPU MatMul lacks, so the translation is run alone on
    float32 against torch's float32 CPU kernel, which has no such restriction."""
    torch.manual_seed(0)
    x, weight = torch.randn(12, 8), torch.randn(4, 8, 4)
    grad = torch.randn(12, 4)
    offsets = torch.tensor([3, 3, 9, 12], dtype=torch.int32)
    leaf_x, leaf_weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = torch._grouped_mm(leaf_x, leaf_weight, offs=offsets)
    expected.backward(grad)
    translation = _aten_grouped_mm_translation()
    torch.testing.assert_close(_evaluate(translation, x, weight, offsets), expected.detach())
    weight_grad = _evaluate(translation, x.t().contiguous(), grad, offsets)
    torch.testing.assert_close(weight_grad, leaf_weight.grad)
    assert not weight_grad[1].any()
    input_grad = _evaluate(translation, grad, weight.transpose(1, 2).contiguous(), offsets)
    torch.testing.assert_close(input_grad, leaf_x.grad)


def test_aten_grouped_mm_without_offsets_keeps_torchlibs_translation():
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, 8), torch.randn(3, 8, 4)
    translation = _aten_grouped_mm_translation()
    torch.testing.assert_close(_evaluate(translation, a, b), torch.bmm(a, b))


def test_a_nan_stays_in_its_experts_gradient_and_rows_past_the_groups_stay_zero():
    """A NaN in one expert's input reaches that expert's weight gradient only, as in eager (no
    product mixes two groups' rows), and rows past the last group are zero even where a weight
    is infinite."""
    _transformers_ops()
    torch.manual_seed(0)
    model = GroupedExperts()
    with torch.no_grad():
        model.weight[3, 0, 0] = float("inf")
    lazy = lazygrad.lazy(copy.deepcopy(model), wait_for_builds=True)
    for _ in range(3):
        x = torch.randn(12, 8)
        x[4, 2] = float("nan")  # a row of the second group
        offsets = torch.tensor([3, 7, 7, 10], dtype=torch.int32)  # rows 10, 11 past them
        outputs = []
        for m in (model, lazy):
            m.zero_grad(set_to_none=True)
            outputs.append(m(x, offsets))
            outputs[-1].sum().backward()
        torch.testing.assert_close(outputs[1], outputs[0], equal_nan=True)
        assert not outputs[1][10:].any()
        torch.testing.assert_close(lazy.weight.grad, model.weight.grad, equal_nan=True)
        assert lazy.weight.grad[1].isnan().any() and not lazy.weight.grad[0].isnan().any()
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 2


def test_expert_weights_and_their_gradients_cross_to_ort_as_slices_while_training():
    """Each expert's weight reaches ORT as a view of the parameter, and each expert's gradient
    block is written into one gradient tensor (capture/stacked_io.py): neither graph ORT runs
    copies the weights or stacks the gradient. Trained with SGD, which updates the parameter
    in place under the bound views, over new routings: outputs and gradients are eager's."""
    _transformers_ops()
    torch.manual_seed(0)
    model = TransposedExperts()
    lazy = lazygrad.lazy(copy.deepcopy(model), wait_for_builds=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, lazy)]
    x = torch.randn(12, 8)
    for ends in ([3, 3, 9, 11], [0, 5, 12, 12], [4, 4, 4, 12], [12, 12, 12, 12]):
        offsets = torch.tensor(ends, dtype=torch.int32)
        outputs = []
        for m, optimizer in zip((model, lazy), optimizers):
            optimizer.zero_grad(set_to_none=True)
            outputs.append(m(x, offsets))
            outputs[-1].pow(2).sum().backward()
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lazy.weight.grad, model.weight.grad, rtol=1e-4, atol=1e-5)
        for optimizer in optimizers:
            optimizer.step()
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 3
    (entry,) = lazygrad.api.runtime_of(lazy)._pairs.values()
    sessions = entry.pair._sessions.values()
    assert sessions and all(session.state_slices for session in sessions)
    assert any(session.stacked_outputs for session in sessions)
    for session in sessions:
        ran = onnx.load_from_string(session._model_bytes)
        assert "Concat" not in {node.op_type for node in ran.graph.node
                                if node.output[0] in {v.name for v in ran.graph.output}}
        weights = set(session.state_slices)
        weights.update(node.output[0] for node in ran.graph.node
                       if node.op_type == "Transpose" and node.input[0] in weights)
        assert not [node for node in ran.graph.node
                    if node.op_type == "Gather" and node.input[0] in weights]


def test_a_value_an_if_branch_reads_survives_the_slicing_of_stacked_weights():
    """A Transpose of a stacked weight that only its Gathers read at the top level is dropped
    once they read the slices (capture/stacked_io.py); one that an If's branch reads too (as
    the checked selections of `zero_where.py` read their operands) stays, and the graph ORT
    runs returns what the unsliced one returns."""
    def branch(name: str, op: str) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)
        return helper.make_graph([helper.make_node(op, ["turned"], [f"{name}_out"])],
                                 name, [], [out])

    nodes = [
        helper.make_node("Transpose", ["weight"], ["turned"], perm=[0, 2, 1]),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor(
            "zero", TensorProto.INT64, [], [0])),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor(
            "one", TensorProto.INT64, [], [1])),
        helper.make_node("Gather", ["turned", "zero"], ["first"], axis=0),
        helper.make_node("Gather", ["turned", "one"], ["second"], axis=0),
        helper.make_node("Add", ["first", "second"], ["summed"]),
        helper.make_node("If", ["flag"], ["either"], then_branch=branch("then", "Neg"),
                         else_branch=branch("else", "Identity")),
    ]
    graph = helper.make_graph(
        nodes, "sliced",
        [helper.make_tensor_value_info("weight", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("summed", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("either", TensorProto.FLOAT, [2, 4, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sliced, inputs, _ = stacked_io.sliced(model, {"weight"})
    assert [entry.name for entry in inputs] == ["weight"]
    onnx.checker.check_model(sliced, full_check=True)
    weight = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    for flag in (True, False):
        feeds = {"weight": weight, "flag": np.array(flag)}
        wanted = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)
        feeds.update({name: weight[index] for index, name in inputs[0].slices})
        got = onnxruntime.InferenceSession(sliced.SerializeToString()).run(None, feeds)
        for actual, expected in zip(got, wanted):
            np.testing.assert_array_equal(actual, expected)
