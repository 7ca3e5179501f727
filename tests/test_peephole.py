"""The peephole rewrites (capture/peephole.py): the same values, fewer passes, eager's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import lazygrad
from lazygrad.capture import peephole, private
from tests.conftest import assert_close, assert_grads_equal

aten = torch.ops.aten


def _decomposed(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    """`fn` traced with symbolic sizes into the decompositions the capture uses."""
    table = private.get_decompositions([
        aten.nll_loss_backward, aten._log_softmax_backward_data, aten.nll_loss_forward,
    ])
    return make_fx(fn, decomposition_table=table, tracing_mode="symbolic")(*inputs)


def _cross_entropy_backward(logits, target, grad, total):
    out = aten._log_softmax.default(logits, 1, False)
    nll = aten.nll_loss_backward.default(grad, out, target, None, 1, -100, total)
    return aten._log_softmax_backward_data.default(nll, out, 1, logits.dtype)


def _targets(rows: int, classes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[::3] = -100  # ignored rows: their gradient is zero
    return target


def _total(target: torch.Tensor) -> torch.Tensor:
    """nll_loss's total weight: the rows not ignored."""
    return (target != -100).sum().float()


@pytest.mark.parametrize("exact", [True, False])
def test_cross_entropy_backward_becomes_softmax_multiply_scatter_add_with_the_same_values(
        exact, monkeypatch):
    """`exact`: the rules exact to the bit alone (the softmax rule left out), whose result
    equals the FX graph's bitwise; with it, within float32's rounding."""
    if exact:
        monkeypatch.setattr(peephole, "RULES", [rule for rule in peephole.RULES
                                                if rule is not peephole.softmax_for_exp])
    logits, target = torch.randn(7, 11), _targets(7, 11, 0)
    gm = _decomposed(_cross_entropy_backward, logits, target, torch.tensor(0.7), _total(target))
    before = copy.deepcopy(gm)
    assert peephole.rewrite(gm) == (3 if exact else 4)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.scatter_add.default in targets
    assert (aten._softmax.default in targets) != exact
    assert (aten._log_softmax.default in targets) == exact
    assert aten.sum.dim_IntList not in targets and aten.zeros_like.default not in targets
    for seed in range(3):  # other sizes, other targets: the graph is symbolic
        rows, classes = 5 + seed, 9 + 4 * seed
        target = _targets(rows, classes, seed)
        inputs = (torch.randn(rows, classes), target, torch.tensor(1.3), _total(target))
        expected = before(*inputs)
        got = gm(*inputs)
        if exact:
            assert torch.equal(got, expected)  # exact, not merely close
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        logits = inputs[0].requires_grad_()
        F.cross_entropy(logits, inputs[1], ignore_index=-100).mul(1.3).backward()
        assert_close(got, logits.grad, "cross-entropy gradient against eager")


def test_scatter_of_several_values_per_row_is_left_as_it_is():
    def fn(x, index, w):
        scattered = torch.zeros_like(x).scatter(1, index, -1.0) * w
        return scattered - x.exp() * scattered.sum(1, keepdim=True)

    x, index, w = torch.randn(4, 6), torch.tensor([[0, 1]] * 4), torch.rand(4, 1)
    gm = _decomposed(fn, x, index, w)
    code = gm.code
    assert peephole.rewrite(gm) == 0  # a row holds two values: its sum is not one of them
    assert gm.code == code


class LanguageModelHead(torch.nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.embed(ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), logits


@pytest.mark.parametrize("mask", [(True, False), (True, True)])
def test_language_model_head_runs_rewritten_through_ort_with_eager_gradients(mask, monkeypatch):
    fired = []
    rewrite = peephole.rewrite
    monkeypatch.setattr(peephole, "rewrite", lambda gm: fired.append(rewrite(gm)) or fired[-1])
    torch.manual_seed(0)
    eager = LanguageModelHead()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 40, (3, 8), generator=generator)
        labels = ids.roll(-1, dims=1)
        labels[:, ::4] = -100
        results = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            loss, logits = model(ids, labels)
            (loss + (logits.pow(2).mean() if mask[1] else 0)).backward()
            results.append((loss, logits))
        assert_close(results[1][0], results[0][0], f"step {step}: loss")
        assert_close(results[1][1], results[0][1], f"step {step}: logits")
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2
    assert sum(fired) == 4  # the backward's cross-entropy, rewritten


class Powers(torch.nn.Module):
    """Each exponent ATen computes by another op, of a parameter's values (so that each has a
    gradient, whose formula reads `pow(x, e - 1)`: 1 among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, x):
        y = x.abs() * self.scale + 0.1
        return y.pow(0.5), y.pow(-0.5), y.pow(-1), y.pow(-2), y.pow(2), y.pow(3), y.pow(1.0) * 3


def test_powers_run_through_ort_as_aten_computes_them_to_the_bit(monkeypatch):
    """ORT's Pow takes std::pow for these exponents (slow); the ops ATen computes them with
    give eager's values exactly, but the square root: ORT's, as its Pow, is an ulp from
    torch's on some elements."""
    fired = []
    rule = peephole.powers_as_aten_computes
    monkeypatch.setattr(peephole, "RULES", [
        r if r is not rule else (lambda graph, node: fired.append(rule(graph, node)) or fired[-1])
        for r in peephole.RULES])
    torch.manual_seed(0)
    eager = Powers()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(3):
        x = torch.randn(32, 64) * 10 ** torch.randint(-3, 4, (32, 1)).float()
        outputs = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            out = model(x)
            sum(o.sum() for o in out).backward()
            outputs.append(out)
        square_root, *others = zip(outputs[1], outputs[0])
        torch.testing.assert_close(*square_root, rtol=1.2e-7, atol=0)
        for got, expected in others:
            assert torch.equal(got, expected), f"step {step}"
        assert_grads_equal(lazy, eager, f"step {step}")
    assert lazygrad.stats(lazy).fallbacks == 0
    assert sum(fired) >= 8  # the forward's seven, and the backward's `pow(y, 1)` at least
