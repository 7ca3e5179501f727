"""Outputs that share memory: a tensor and a view of it, two views of one intermediate, a view of
an input, a parameter itself. AOTAutograd gives a cotangent only to outputs that alias nothing;
lazygrad passes their roots through autograd and makes every output from its root in torch
(`capture/aliases.py`); an output a custom autograd Function made is a root of its own.
Before, `hidden, hidden[:, 0]` trained silently wrong through ORT
(the view's gradient was dropped), and two views of one tensor crashed in backward."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from conftest import assert_close, assert_grads_equal, ran_through_ort, squares_step_like_eager

import lazygrad


class GradientReversal(torch.autograd.Function):
    """Returns a view of its input with a backward of its own, as domain-adversarial models do."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


OUTPUTS = {
    "tensor and its first token": lambda y, x, m: (y, y[:, 0]),
    "first token, then the tensor": lambda y, x, m: (y[:, 0], y),
    "the same tensor twice": lambda y, x, m: (y, y),
    "two views of an intermediate": lambda y, x, m: (y.transpose(0, 1), y[:, 2:]),
    "tensor and its transpose": lambda y, x, m: (y, y.transpose(0, 1)),
    "chunks": lambda y, x, m: y.chunk(2, dim=-1),
    "unbound rows": lambda y, x, m: y.unbind(0),
    "a diagonal": lambda y, x, m: (y[:, :4].diagonal(),),
    "a view of the input": lambda y, x, m: (y, x.view(-1)),
    "the input itself": lambda y, x, m: (y, x),
    "a parameter": lambda y, x, m: (y, m.linear.weight),
    "a view of a parameter": lambda y, x, m: (y, m.linear.weight.t()),
    # A custom Function's view is a root: replayed on its base, the view skipped the Function's
    # backward (the reversed gradient came out with the wrong sign, at every step, through ORT).
    "a gradient reversal of the tensor": lambda y, x, m: (GradientReversal.apply(y),),
    "a tensor and its gradient reversal": lambda y, x, m: (2 * y, GradientReversal.apply(y)),
    # Eager's batched matmul returns a tensor of its own; traced, it was a view of the batch-
    # folded product, and the module ran in parts ("disagree on which outputs share memory").
    "batched matmuls": lambda y, x, m: _batched_matmuls(y),
}


def _batched_matmuls(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    heads = y.view(y.shape[0], 2, 2, 2).transpose(1, 2)
    return y.view(y.shape[0], 2, 4) @ y.view(y.shape[0], 2, 4).transpose(1, 2), \
        heads.unsqueeze(1) @ heads.transpose(-1, -2)


class Shared(torch.nn.Module):
    """tanh saves its output for backward: a root the backward reads."""

    def __init__(self, outputs) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.outputs = outputs

    def forward(self, x: torch.Tensor):
        return self.outputs(torch.tanh(self.linear(x)), x, self)


def _pair(outputs) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    eager = Shared(outputs)
    return lazygrad.lazy(copy.deepcopy(eager)), eager


def _step(lazy, eager, x, weights, pick=None):
    """Forward both, backward sum_i <w_i, out_i> over the picked outputs; compare all."""
    for module in (lazy, eager):
        module.zero_grad(set_to_none=True)
    x_lazy, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = lazy(x_lazy), eager(x_eager)
    pick = pick if pick is not None else range(len(want))
    for index, (a, b) in enumerate(zip(got, want)):
        assert_close(a.detach(), b.detach(), f"output {index}")
    sum((got[i] * weights[i]).sum() for i in pick).backward()
    sum((want[i] * weights[i]).sum() for i in pick).backward()
    assert_grads_equal(lazy, eager, "parameters")
    assert_close(x_lazy.grad, x_eager.grad, "input")


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_outputs_that_share_memory_train_like_eager(name):
    lazy, eager = _pair(OUTPUTS[name])
    torch.manual_seed(1)
    for _ in range(4):
        x = torch.randn(4, 8)
        weights = [torch.randn_like(o) for o in eager(x)]
        _step(lazy, eager, x, weights)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    assert stats.hits == 3


def test_a_view_alone_gets_the_gradient_some_steps():
    """The view's gradient reaches its root; the masks of one root are one unit."""
    lazy, eager = _pair(OUTPUTS["tensor and its first token"])
    torch.manual_seed(2)
    for step in range(6):
        x = torch.randn(4, 8)
        weights = [torch.randn_like(o) for o in eager(x)]
        _step(lazy, eager, x, weights, pick=[1] if step % 2 else [0, 1])
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    assert stats.builds == 1  # one root, always with a gradient


def test_batched_matmul_outputs_train_like_eager_as_the_mask_changes():
    """The step after a new mask redoes its backward in eager PyTorch from the saved inputs
    (policy "predict"): its roots are the clones the trace made of the products."""
    lazy, eager = _pair(OUTPUTS["batched matmuls"])
    torch.manual_seed(4)
    for step in range(6):
        x = torch.randn(4, 8)
        weights = [torch.randn_like(o) for o in eager(x)]
        _step(lazy, eager, x, weights, pick=[[0], [0], [1], [0, 1], [1], [0]][step])
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    assert stats.hits >= 3 and stats.recomputes >= 1


def test_views_of_outputs_change_in_place_as_in_eager():
    """`y = proj(x).permute(...); y /= 2` failed at every step ("a view created inside a
    custom Function"); now the view is made outside the autograd node, at the first step too."""
    lazy, eager = _pair(lambda y, x, m: ((2 * y).view(y.shape[0], 2, 4).permute(1, 0, 2),))
    torch.manual_seed(3)
    for _ in range(3):
        for module in (lazy, eager):
            module.zero_grad(set_to_none=True)
        x = torch.randn(4, 8)
        (got,), (want,) = lazy(x), eager(x)
        got.mul_(2)
        want.mul_(2)
        assert_close(got.detach(), want.detach(), "output")
        (got * got).sum().backward()
        (want * want).sum().backward()
        assert_grads_equal(lazy, eager, "parameters")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


def test_an_in_place_change_of_a_saved_root_is_refused_as_in_eager():
    """tanh's backward reads its output: changing a view of it in place must fail at backward,
    as eager's version check fails, and never give gradients of the changed values."""
    lazy, eager = _pair(lambda y, x, m: (y.transpose(0, 1),))
    for module in (lazy, eager):
        module(torch.randn(4, 8))[0].sum().backward()  # lazy: eagerly, then built
        (out,) = module(torch.randn(4, 8))
        assert module is eager or ran_through_ort([out])
        out.mul_(2)
        with pytest.raises(RuntimeError, match="inplace"):
            out.sum().backward()
    assert lazygrad.stats(lazy).fallbacks == 0


class ProjectedThroughDropout(torch.nn.Module):
    """Ends in a Linear of a sequence through Dropout(p=0): eager's Linear returns a view of
    its 2-D product, and Dropout without a draw hands it through."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.projection = torch.nn.Linear(8, 6)
        self.dropout = torch.nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.projection(self.norm(x)))


@pytest.mark.parametrize("training", [True, False])
def test_dropout_without_a_draw_hands_its_input_through_as_in_eager(training):
    """torch's decomposition of `dropout` without a draw (p 0, or eval) returns a clone where
    eager returns its input: the output was a view (of the Linear's product) in eager and a
    tensor of its own in the trace, and the module ran in parts (wav2vec2's feature projection,
    every HF model's dropout set to 0). It is traced as eager runs it; torch's own
    decomposition is back once the trace is done."""
    torch.manual_seed(0)
    eager = ProjectedThroughDropout(0.0).train(training)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        squares_step_like_eager(lazy, eager, (torch.randn(2, 5, 8),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    decompositions = importlib.import_module("torch._decomp.decompositions")
    assert all(kernel is decompositions.dropout
               for kernel in torch.ops.aten.dropout.default.py_kernels.values()
               if getattr(kernel, "__name__", "") == "dropout")


class JacobianPerSample(torch.nn.Module):
    """A per-sample Jacobian made with `torch.func` in the forward: vmap's rules trace a
    `prims.squeeze` among the views that make the output from its root."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        energy = lambda v: torch.tanh(self.linear(v)).sum()  # noqa: E731
        return torch.func.vmap(torch.func.jacrev(energy))(x)


def test_an_output_made_by_a_prims_view_is_made_by_its_aten_twin():
    """The prims view, replayed in torch, has no autograd formula: the second step's backward
    failed ("backwards not supported on prim")."""
    torch.manual_seed(0)
    eager = JacobianPerSample()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(3):
        out = squares_step_like_eager(lazy, eager, (torch.randn(5, 4),), f"step {step}")
    assert ran_through_ort([out])
    stats = lazygrad.stats(lazy)
    assert (stats.hits, stats.fallbacks, stats.breaks) == (2, 0, 0), stats.reasons
