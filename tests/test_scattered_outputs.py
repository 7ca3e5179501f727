"""A gradient that a scatter-add into zeros makes (an embedding's) is returned as its additions
and added into one buffer in torch (capture/scattered_outputs.py)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from conftest import (
    assert_close,
    assert_grads_equal,
    assert_loss_step_like_eager,
    ran_through_ort,
    run_onnx_as_written,
)
from onnx import TensorProto, helper

import lazygrad
from lazygrad import attach
from lazygrad.capture import scattered_outputs, segment
from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch


def _rows(zero: float) -> onnx.ModelProto:
    """grad = ScatterElements(CastLike(ConstantOfShape([6, 3], zero), g), expanded ids, g * 2,
    add), as an embedding's backward is exported; `out` reads g too."""
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=helper.make_tensor(
            "shape", TensorProto.INT64, [2], [6, 3])),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=helper.make_tensor(
            "value", TensorProto.FLOAT, [1], [zero])),
        helper.make_node("CastLike", ["zeros", "g"], ["like"]),
        helper.make_node("Mul", ["g", "g"], ["added"]),
        helper.make_node("Expand", ["ids", "wide"], ["index"]),
        helper.make_node("ScatterElements", ["like", "index", "added"], ["grad"], axis=0,
                         reduction="add"),
        helper.make_node("Neg", ["g"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, [5, 3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [5, 1]),
         helper.make_tensor_value_info("wide", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("grad", TensorProto.FLOAT, [6, 3]),
         helper.make_tensor_value_info("out", TensorProto.FLOAT, [5, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_gradient_is_its_additions_scattered_into_zeros_in_torch():
    rng = np.random.default_rng(0)
    feeds = {"g": rng.standard_normal([5, 3], dtype=np.float32),
             "ids": np.array([[1], [4], [1], [0], [4]]), "wide": np.array([5, 3])}
    model = _rows(0.0)
    grad, out = run_onnx_as_written(model, feeds)
    rewritten = scattered_outputs.added_in_torch(model, {"grad", "out"})
    ops = {node.op_type for node in rewritten.graph.node}
    assert not ops & {"ScatterElements", "ConstantOfShape", "CastLike"}
    found = scattered_outputs.scattered(rewritten)
    assert found == {"grad": ("index", 0, [6, 3], None)}
    names = [value.name for value in rewritten.graph.output]
    assert names == ["grad", "out", "index"]
    added, got_out, index = run_onnx_as_written(rewritten, feeds)
    np.testing.assert_array_equal(got_out, out)
    scattered = torch.zeros(6, 3).scatter_add_(0, torch.from_numpy(index),
                                               torch.from_numpy(added))
    np.testing.assert_array_equal(scattered.numpy(), grad)


def _tied() -> onnx.ModelProto:
    """grad = product + the scatter of `_rows`: a tied weight's gradient."""
    model = _rows(0.0)
    graph = model.graph
    (scatter,) = [node for node in graph.node if node.op_type == "ScatterElements"]
    scatter.output[0] = "rows"
    graph.node.extend([helper.make_node("MatMul", ["w", "h"], ["product"]),
                       helper.make_node("Add", ["product", "rows"], ["grad"])])
    graph.input.extend([helper.make_tensor_value_info("w", TensorProto.FLOAT, [6, 4]),
                        helper.make_tensor_value_info("h", TensorProto.FLOAT, [4, 3])])
    graph.value_info.append(helper.make_tensor_value_info("product", TensorProto.FLOAT, [6, 3]))
    return model


def test_a_tied_weights_gradient_is_the_other_gradient_added_into_in_torch():
    rng = np.random.default_rng(1)
    feeds = {"g": rng.standard_normal([5, 3], dtype=np.float32),
             "ids": np.array([[1], [4], [1], [0], [4]]), "wide": np.array([5, 3]),
             "w": rng.standard_normal([6, 4], dtype=np.float32),
             "h": rng.standard_normal([4, 3], dtype=np.float32)}
    model = _tied()
    grad, out = run_onnx_as_written(model, feeds)
    rewritten = scattered_outputs.added_in_torch(model, {"grad", "out"})
    ops = [node.op_type for node in rewritten.graph.node]
    assert "ScatterElements" not in ops and "Add" not in ops and "ConstantOfShape" not in ops
    assert scattered_outputs.scattered(rewritten) == {"grad": ("index", 0, [6, 3], "added")}
    assert [value.name for value in rewritten.graph.output] == ["grad", "out", "index", "added"]
    product, got_out, index, added = run_onnx_as_written(rewritten, feeds)
    np.testing.assert_array_equal(got_out, out)
    summed = torch.from_numpy(product).scatter_add_(0, torch.from_numpy(index),
                                                    torch.from_numpy(added))
    np.testing.assert_allclose(summed.numpy(), grad, rtol=1e-6, atol=1e-6)


def test_a_scatter_into_what_is_not_zeros_stays():
    model = _rows(1.0)
    assert scattered_outputs.scattered(scattered_outputs.added_in_torch(model, {"grad"})) == {}
    assert "ScatterElements" in {node.op_type for node in model.graph.node}


class Tagger(torch.nn.Module):
    """Token embeddings (untied), a layer, a tagging head and a language-model head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 32)
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.tags = torch.nn.Linear(32, 5)
        self.words = torch.nn.Linear(32, 300)

    def forward(self, ids):
        h = self.layer(self.embed(ids))
        return self.tags(h), self.words(h)


@pytest.mark.parametrize("segments", [1, 4])
def test_an_embeddings_gradient_added_in_torch_trains_like_eager_for_every_mask(
        monkeypatch, segments):
    monkeypatch.setattr(segment, "STASH_PER_SEGMENT", 1)  # a small graph is cut too
    torch.manual_seed(0)
    eager = Tagger()
    lazy = lazygrad.lazy(copy.deepcopy(eager), segments=segments)
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(1))
    losses = [lambda o: o[0].square().sum(), lambda o: o[1].logsumexp(-1).sum(),
              lambda o: o[0].sum() + o[1].square().mean()]
    for step in range(6):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        out, expected = lazy(ids), eager(ids)
        for got, want in zip(out, expected):
            assert_close(got.detach(), want.detach(), f"step {step}: output")
        losses[step % 3](out).backward()
        losses[step % 3](expected).backward()
        assert_grads_equal(lazy, eager, f"step {step}")
        assert step < 3 or ran_through_ort(out)
    pairs = [entry.pair for entry in attach.installed(lazy)._pairs.values()
             if entry.pair.graphs.backward is not None]
    assert pairs and all(
        scattered_outputs.scattered(pair.graphs.backward) for pair in pairs)
    assert all(len(pair.graphs.backward_segments) > 1 for pair in pairs) == (segments > 1)
    assert lazygrad.stats(lazy).fallbacks == 0


def test_a_tied_embeddings_gradient_added_in_torch_trains_like_eager():
    """BertPretraining's word embedding is its output layer's weight: trained through the
    language-model loss, its gradient is the two gradients' sum, added into in torch."""
    torch.manual_seed(0)
    config = BertConfig(vocab=200, hidden=32, layers=1, heads=4)
    eager = BertPretraining(config)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    inputs = bert_batch(config, batch=2, seq=12)
    for step in range(4):
        assert_loss_step_like_eager(lazy, eager, inputs, f"step {step}")
    (entry,) = [e for e in attach.installed(lazy)._pairs.values() if e.pair.graphs.backward]
    found = scattered_outputs.scattered(entry.pair.graphs.backward)
    assert sorted(added is not None for *_, added in found.values()) == [False, True]
    assert lazygrad.stats(lazy).fallbacks == 0 and lazygrad.stats(lazy).hits >= 2
