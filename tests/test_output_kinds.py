"""Outputs that cannot carry a gradient are plain tensors; strict mode refuses to fall back."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_close

import lazygrad


class MixedOutputs(torch.nn.Module):
    """A float head, an integer prediction, a boolean flag and a float computed from no weight."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x, labels):
        logits = self.head(x)
        return logits, logits.argmax(-1), logits.sum(-1) > 0, labels.float().mean() * 2


def test_integer_boolean_and_weightless_outputs_are_non_differentiable():
    torch.manual_seed(0)
    model = MixedOutputs()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    x, labels = torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    logits, predicted, flag, label_mean = lazy(x, labels)
    expected = model(x, labels)
    assert logits.requires_grad
    assert not predicted.requires_grad and predicted.dtype == torch.int64
    assert not flag.requires_grad and flag.dtype == torch.bool
    assert not label_mean.requires_grad
    assert torch.equal(predicted, expected[1]) and torch.equal(flag, expected[2])
    assert_close(label_mean, expected[3], "weightless output")
    logits.square().sum().backward()
    expected[0].square().sum().backward()
    assert_close(lazy.head.weight.grad, model.head.weight.grad, "head weight grad")


class Unexportable(torch.nn.Module):
    """`cummax` traces, but has no ONNX translation: the build fails at export."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cummax(self.linear(x), -1)[0].sum(-1)


def test_strict_mode_raises_instead_of_falling_back():
    model = lazygrad.lazy(Unexportable(), strict=True)
    out = model(torch.randn(2, 4))  # the first step runs eagerly; the build is at its backward
    with pytest.raises(lazygrad.LazygradError, match="cummax"):
        out.sum().backward()
    assert lazygrad.stats(model).fallbacks == 0


@pytest.mark.falls_back
def test_fallback_trains_in_eager_and_is_counted_once():
    torch.manual_seed(0)
    plain = Unexportable()
    model = lazygrad.lazy(copy.deepcopy(plain))
    x = torch.randn(3, 4)
    with pytest.warns(lazygrad.FallbackWarning, match="cummax"):
        model(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the signature stays in eager
        model(x).sum().backward()
    plain(x).sum().backward()
    plain(x).sum().backward()
    assert_close(model.linear.weight.grad, plain.linear.weight.grad, "eager fallback grad")
    stats = lazygrad.stats(model)  # its own code in eager PyTorch, its Linear on its own
    assert stats.breaks == 1 and stats.fallbacks == 0


@pytest.mark.falls_back
def test_autocast_is_part_of_the_signature_and_an_unloadable_graph_falls_back():
    """ORT's CPU provider has no bfloat16 Gemm: that graph falls back whole, with one warning
    (its parts would fail alike: each of a 2-layer BERT's tried and warned, 14 warnings);
    float32 outside runs ORT."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = lazygrad.lazy(copy.deepcopy(plain))
    x = torch.randn(4, 8)
    for step in range(2):  # the build at the first backward fails; the second step is eager
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            expected = plain(x)
        assert out.dtype == expected.dtype == torch.bfloat16
        assert torch.equal(out, expected)
        if step == 0:
            with pytest.warns(lazygrad.FallbackWarning, match="cannot load the graph"):
                out.float().sum().backward()
    for _ in range(2):
        out_fp32 = model(x)
        out_fp32.sum().backward()
    assert type(out_fp32.grad_fn).__name__ == "LazyFunctionBackward"
    assert_close(out_fp32.detach(), plain(x).detach(), "float32 output outside autocast")
    stats = lazygrad.stats(model)
    assert (stats.exports, stats.breaks, stats.fallbacks) == (1, 0, 1) and not stats.parts
