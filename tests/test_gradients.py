"""Gradients of every loss composition match PyTorch's, for every grad mask of three models."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    MODEL_CASES,
    all_masks,
    assert_close,
    compose_loss,
    eager_none_pattern,
    lazy_copy,
    ran_through_ort,
    reference_vjp,
)

import lazygrad
from lazygrad.examples.models import ThreeHeadMLP

OUTPUTS = {"three_head_mlp": 3, "bert": 3, "moe": 2}
# Every mask of every model under the default policy; under the other two, every mask of the
# cheap models and, of BERT (each capture costs seconds), all outputs and one partial mask.
CASES = [
    (policy, name, mask)
    for policy in ("predict", "all", "recompute")
    for name in sorted(MODEL_CASES)
    for mask in all_masks(OUTPUTS[name])
    if policy == "predict" or name != "bert" or mask in {(True, True, True), (True, False, False)}
]


@pytest.mark.parametrize(
    ("policy", "name", "mask"), CASES, ids=[f"{p}-{n}-{m}" for p, n, m in CASES]
)
def test_every_mask_matches_vjp_outputs_grads_and_none_pattern(policy, name, mask):
    model, inputs = MODEL_CASES[name]()
    lazy = lazy_copy(model, policy=policy)
    for seed in range(2):  # a second step: the cached graph (and, for predict, a new stash plan)
        generator = torch.Generator().manual_seed(seed)
        outputs = lazy(*inputs)
        cotangents = [torch.randn(o.shape, generator=generator) for o in outputs]
        expected_outputs, expected_grads, _ = reference_vjp(model, inputs, mask, cotangents)
        for index, (got, want) in enumerate(zip(outputs, expected_outputs)):
            assert_close(got.detach(), want, f"output {index}")
        lazy.zero_grad(set_to_none=True)
        compose_loss(outputs, mask, cotangents).backward()
        none_in_eager = eager_none_pattern(model, inputs, mask)
        for param_name, param in lazy.named_parameters():
            assert (param.grad is None) == none_in_eager[param_name], param_name
            if param.grad is not None:
                assert_close(param.grad, expected_grads[param_name], f"grad of {param_name}")
    assert ran_through_ort(outputs)  # the second step: the first runs eagerly and builds
    assert lazygrad.stats(lazy).fallbacks == 0


@pytest.mark.parametrize("mask", all_masks(3))
def test_input_gradients_match_vjp(mask):
    torch.manual_seed(1)
    model = ThreeHeadMLP()
    x = torch.randn(5, 16, requires_grad=True)
    lazy = lazy_copy(model)
    outputs = lazy(x)
    cotangents = [torch.randn_like(o) for o in outputs]
    _, _, (expected_x_grad,) = reference_vjp(model, (x,), mask, cotangents)
    compose_loss(outputs, mask, cotangents).backward()
    assert_close(x.grad, expected_x_grad, "grad of x")


def test_output_that_feeds_another_output_gets_both_contributions():
    """(loss + prediction_scores.sum()).backward(): scores is also an intermediate of loss."""
    model, inputs = MODEL_CASES["bert"]()
    lazy = lazy_copy(model)
    eager = copy.deepcopy(model)
    loss, scores, _ = lazy(*inputs)
    (loss + scores.sum()).backward()
    eager_loss, eager_scores, _ = eager(*inputs)
    (eager_loss + eager_scores.sum()).backward()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert_close(p.grad, q.grad, name)


def test_output_used_twice_in_the_loss():
    model, (x,) = MODEL_CASES["three_head_mlp"]()
    lazy, eager = lazy_copy(model), copy.deepcopy(model)
    for m in (lazy, eager):
        a, b, _ = m(x)
        (a.sum() * 3 + (a * a).sum() + b.mean()).backward()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert_close(p.grad, q.grad, name)


def test_same_tensor_passed_twice_gets_the_sum_of_both_gradients():
    class Bilinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 4)

        def forward(self, a, b):
            return (self.w(a) * torch.tanh(b)).sum(-1), a.mean()

    torch.manual_seed(2)
    model = Bilinear()
    lazy = lazy_copy(model)
    x = torch.randn(3, 4, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out, _ = lazy(x, x)
    out.sum().backward()
    out_eager, _ = model(x_eager, x_eager)
    out_eager.sum().backward()
    assert_close(out.detach(), out_eager.detach(), "output")
    assert_close(x.grad, x_eager.grad, "grad of x")


def test_non_contiguous_and_expanded_cotangents():
    model, (x,) = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    a, b, c = lazy(x)
    grad_b = torch.randn(b.shape[1], b.shape[0]).t()  # transposed: not contiguous
    grad_c = torch.randn(1, c.shape[1]).expand_as(c)  # stride 0
    assert not grad_b.is_contiguous() and not grad_c.is_contiguous()
    torch.autograd.backward([b, c], [grad_b, grad_c])
    _, expected, _ = reference_vjp(model, (x,), (False, True, True), [a, grad_b, grad_c])
    for name, p in lazy.named_parameters():
        if p.grad is not None:
            assert_close(p.grad, expected[name], name)
    assert lazy.regress.weight.grad is None  # head of the output that got no gradient


def test_gradients_accumulate_across_two_backward_calls_like_eager():
    model, (x,) = MODEL_CASES["three_head_mlp"]()
    lazy, eager = lazy_copy(model), copy.deepcopy(model)
    for m in (lazy, eager):
        m(x)[0].sum().backward()
        m(x)[1].sum().backward()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert_close(p.grad, q.grad, name)
    assert lazygrad.stats(lazy).misses == 2
