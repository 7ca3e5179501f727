"""Cross-entropy is decomposed for ORT; values and gradients stay PyTorch's for every variant."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close

import lazygrad
from lazygrad.api import runtime_of


class Classifier(torch.nn.Module):
    def __init__(self, reduction: str, ignore_index: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 5)
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, x, labels):
        logits = self.linear(x)
        loss = torch.nn.functional.cross_entropy(
            logits, labels, reduction=self.reduction, ignore_index=self.ignore_index
        )
        return loss, logits


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_decomposed_cross_entropy_matches_eager(reduction, ignore_index):
    torch.manual_seed(0)
    eager = Classifier(reduction, ignore_index)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(7, 6)
    labels = torch.tensor([0, 2, 4, ignore_index, 1, 2, 3])
    loss, logits = lazy(x, labels)
    expected_loss, expected_logits = eager(x, labels)
    assert_close(loss.detach(), expected_loss.detach(), "loss")
    cotangent = torch.randn_like(loss)
    (loss * cotangent).sum().backward()
    (expected_loss * cotangent).sum().backward()
    assert_close(lazy.linear.weight.grad, eager.linear.weight.grad, "weight grad")
    assert_close(lazy.linear.bias.grad, eager.linear.bias.grad, "bias grad")
    graph = next(iter(runtime_of(lazy)._signatures.values())).exported.model
    assert "SoftmaxCrossEntropyLoss" not in {node.op_type for node in graph.graph.node}
