"""Rows summed into a few rows as one product (capture/few_rows.py), and `x[ids]` as one
Gather (`lowerings.gather_rows`): a Mixture-of-Experts layer that gathers each token's expert
weights, trained like eager, special values included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import lazygrad
from lazygrad.capture import few_rows, lowerings
from tests.conftest import (
    assert_close,
    assert_grads_equal,
    counted_rewrites,
    ran_through_ort,
    sum_step_like_eager,
)

aten = torch.ops.aten


@pytest.fixture
def fired(monkeypatch) -> list[int]:
    """What each of the rewrite's calls rewrote, in order (the builds' graphs)."""
    return counted_rewrites(monkeypatch, few_rows)


def _base(rows: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_full((rows, 3, 5), 0.5)


def _rows_summed(rows: int):
    """An embedding's backward as the capture lowers it: `scatter_add` of rows into `rows`
    rows (a number, as a weight's shape is), the number of source rows a symbol."""
    def summed(ids, src):
        return lowerings.accumulate_rows(_base(rows, src), [ids], src, True)
    return summed


def _inputs(rows: int, count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(-rows, rows, (count,), generator=generator),
            torch.randn(count, 3, 5, generator=generator))


def _eager(rows: int, ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return _base(rows, src).index_put_([ids], src, accumulate=True)


def _rewritten(rows: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """(the graph as traced, the graph rewritten, how many sums were rewritten)."""
    gm = make_fx(_rows_summed(rows), tracing_mode="symbolic")(*_inputs(rows, 7, 0))
    dense = copy.deepcopy(gm)
    return dense, gm, few_rows.rewrite(gm)


def test_rows_summed_into_few_rows_are_a_product_with_eagers_sums():
    dense, gm, fired = _rewritten(rows=4)
    assert fired == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.mm.default in targets
    for seed, count in enumerate([7, 1, 30, 0]):  # other numbers of source rows: a symbol
        inputs = _inputs(4, count, seed)
        expected = _eager(4, *inputs)
        torch.testing.assert_close(gm(*inputs), expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gm(*inputs), dense(*inputs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
def test_a_value_not_finite_gives_eagers_result_in_every_row(special):
    """A zero times an infinity is NaN: the product would spread it to every row. There every
    row is scattered as eager adds them: the same result, bit for bit."""
    _, gm, fired = _rewritten(rows=4)
    assert fired == 1
    ids, src = _inputs(4, 9, 3)
    src[2, 1, 4] = special
    expected = _eager(4, ids, src)
    assert not expected.isfinite().all() and expected.isfinite().any()
    torch.testing.assert_close(gm(ids, src), expected, rtol=0, atol=0, equal_nan=True)


def test_many_destination_rows_stay_a_scatter(monkeypatch):
    """An embedding table of thousands of rows: a product would cost one multiply-add per row
    and source element."""
    monkeypatch.setattr(few_rows, "ROWS_AT_MOST", 3)
    dense, gm, fired = _rewritten(rows=4)
    assert fired == 0 and str(gm.graph) == str(dense.graph)


class GatheredExperts(torch.nn.Module):
    """Each token's two experts' weights gathered, then a batched product (transformers'
    `batched_mm` experts): the weights' gradient sums token rows into a few experts."""

    def __init__(self, experts: int = 4, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, experts)
        self.up = torch.nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)

    def forward(self, x):
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        tokens = x.repeat_interleave(2, dim=0).unsqueeze(-1)  # [tokens * 2, dim, 1]
        flat = chosen.reshape(-1)
        h = torch.relu(torch.bmm(self.up[flat], tokens))
        out = torch.bmm(self.down[-4 + flat], h).squeeze(-1)  # negative ids: from the end
        return (out.view(-1, 2, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)


def _expert_steps(lazy, eager, batches, gradient=None):
    for step, tokens in enumerate(batches):
        x = torch.randn(tokens, 8)
        outputs = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            out = model(x)
            out.backward(torch.ones_like(out) if gradient is None else gradient(out))
            outputs.append(out)
        assert_close(outputs[1], outputs[0], f"step {step}: output")
    return outputs[1]


def test_gathered_experts_train_like_eager_through_ort(fired):
    torch.manual_seed(0)
    eager = GatheredExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    last = _expert_steps(lazy, eager, [12, 12, 9, 20])
    assert_grads_equal(lazy, eager, "gathered experts")
    assert ran_through_ort([last])
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.builds >= 1
    assert [count for count in fired if count] == [2] * stats.builds  # each backward: up, down


def test_gathered_experts_given_an_infinite_gradient_have_eagers_gradients():
    """An overflow reaching the experts' weights: eager's infinities and NaN where eager has
    them, the other experts' gradients finite as eager's."""
    torch.manual_seed(0)
    eager = GatheredExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    _expert_steps(lazy, eager, [12, 12])

    def overflowed(out):
        gradient = torch.ones_like(out)
        gradient[3, 2] = float("inf")
        return gradient

    last = _expert_steps(lazy, eager, [12], overflowed)
    assert ran_through_ort([last]) and lazygrad.stats(lazy).fallbacks == 0
    for name, parameter in eager.named_parameters():
        got = dict(lazy.named_parameters())[name].grad
        assert torch.equal(got.isfinite(), parameter.grad.isfinite()), name
        assert torch.equal(got.isnan(), parameter.grad.isnan()), name
        kept = parameter.grad.isfinite()
        torch.testing.assert_close(got[kept], parameter.grad[kept], rtol=1e-5, atol=1e-6)
    assert not dict(eager.named_parameters())["up"].grad.isfinite().all()


def test_indexing_along_a_later_dimension_by_ids_of_any_shape_trains_like_eager():
    """`x[:, ids]`, ids of two dimensions, some negative: one Gather, eager's values and
    gradients."""
    class Picks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(3, 10, 4))

        def forward(self, ids):
            return self.table[:, ids] * 2

    torch.manual_seed(0)
    eager = Picks()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(3):
        ids = torch.randint(-10, 10, (2, 5))
        outputs = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            out = model(ids)
            out.pow(2).sum().backward()
            outputs.append(out)
        assert_close(outputs[1], outputs[0], f"step {step}: output")
        assert_grads_equal(lazy, eager, f"step {step}")
    assert ran_through_ort([outputs[1]]) and lazygrad.stats(lazy).fallbacks == 0


def test_a_forward_pooling_rows_into_a_few_trains_like_eager(fired):
    """A graph network's sum pooling of node rows into their graphs' rows (PyG's `scatter`:
    `scatter_add_` of an expanded index; `index_add_`): rewritten in the forward, over changing
    numbers of nodes."""
    class Pool(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

        def forward(self, x, graph):
            h = torch.relu(self.embed(x))
            summed = h.new_zeros(4, h.shape[1]).scatter_add_(0, graph.view(-1, 1).expand_as(h), h)
            return self.head(summed + torch.zeros(4, h.shape[1]).index_add_(0, graph, h))

    torch.manual_seed(0)
    eager = Pool()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, nodes in enumerate([20, 20, 31, 7]):
        x, graph = torch.randn(nodes, 8), torch.randint(0, 4, (nodes,))
        outputs = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            outputs.append(model(x, graph))
            outputs[-1].pow(2).sum().backward()
        assert_close(outputs[1], outputs[0], f"step {step}: output")
        assert_grads_equal(lazy, eager, f"step {step}")
    assert ran_through_ort([outputs[1]]) and lazygrad.stats(lazy).fallbacks == 0
    assert [count for count in fired if count] == [2] * lazygrad.stats(lazy).builds


def _one_row_rewritten(function, *inputs):
    """Traced at these sizes (the capture's row sizes are numbers: a batch is the symbol)."""
    gm = make_fx(function, tracing_mode="fake")(*inputs)
    traced = copy.deepcopy(gm)
    return traced, gm, few_rows.rewrite(gm)


@pytest.mark.parametrize("keepdim", [False, True])
def test_a_sum_over_the_leading_dimensions_is_a_product_by_ones(keepdim):
    """A bias's gradient (`sum(grad, [0, 1])`): every row summed into one, `ones @ rows`, the
    same terms in a matmul's order; infinities and NaN where eager's sum has them."""
    def bias_gradient(grad):
        return grad.sum((0, 1), keepdim=keepdim)

    _, gm, fired = _one_row_rewritten(bias_gradient, torch.randn(8, 40, 64))
    assert fired == 1 and aten.mm.default in [n.target for n in gm.graph.nodes]
    for seed in range(3):
        grad = torch.randn(8, 40, 64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(gm(grad), bias_gradient(grad), rtol=1e-5, atol=1e-5)
    grad = torch.randn(8, 40, 64)
    grad[1, 2, 3], grad[4, 5, 3], grad[0, 0, 9] = float("inf"), float("-inf"), float("nan")
    grad[2, 2, 10] = float("inf")
    got, expected = gm(grad), bias_gradient(grad)
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
    assert expected.isnan().sum() == 2 and expected.isinf().sum() == 1


@pytest.mark.parametrize("shape, dims", [
    ((8, 40, 64), (1,)),  # not the leading dimensions
    ((8, 40, 64), (0, 1, 2)),  # every dimension: no row left
    ((16, 32), (0,)),  # 512 elements: ORT's ReduceSum is as fast
])
def test_other_sums_stay_sums(shape, dims):
    traced, gm, fired = _one_row_rewritten(lambda x: x.sum(dims), torch.randn(*shape))
    assert fired == 0 and str(gm.graph) == str(traced.graph)


def test_bias_gradients_through_ort_are_eagers(fired):
    """A two-layer MLP over [batch, tokens, features]: its biases' gradients are sums over the
    leading dimensions, each rewritten in the backward, eager's gradients, over changing
    batches (the batch a symbol)."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, batch in enumerate([4, 4, 6, 9]):
        last = sum_step_like_eager(lazy, eager, (torch.randn(batch, 80, 64),), f"step {step}",
                                   lambda out: out.pow(2).mean())
    assert ran_through_ort([last]) and lazygrad.stats(lazy).fallbacks == 0
    assert [count for count in fired if count] == [2] * lazygrad.stats(lazy).builds
