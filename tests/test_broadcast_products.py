"""Products whose operands broadcast, computed without the broadcast result
(capture/broadcast_products.py): a contraction as one matmul, a product read by selects as the
selects' products; eager's values, special values included, and a dense Mixture-of-Experts
layer trained like eager through ORT."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import lazygrad
from lazygrad.capture import broadcast_products
from lazygrad.examples.models import MoELayer
from tests.conftest import (
    assert_close,
    assert_grads_equal,
    counted_rewrites,
    ran_through_ort,
    squares_step_like_eager,
)

aten = torch.ops.aten


@pytest.fixture
def fired(monkeypatch) -> list[int]:
    """What each of the rewrite's calls rewrote, in order (the builds' graphs)."""
    return counted_rewrites(monkeypatch, broadcast_products)


def _rewritten(function, *inputs):
    """(the graph as traced, the graph rewritten, how many products were rewritten)."""
    gm = make_fx(function, tracing_mode="symbolic")(*inputs)
    traced = copy.deepcopy(gm)
    return traced, gm, broadcast_products.rewrite(gm)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


# Contractions of a broadcasting product: (function, its operands' shapes). Each sums over one
# dimension both operands have; the others are kept by both (a batch), by one alone, or are 1.
CONTRACTIONS = {
    "experts mixed (the dense MoE forward)":
        (lambda x, w: (x * w.unsqueeze(-2)).sum(-1), [(2, 5, 6, 4), (2, 5, 4)]),
    "scores of hand-written attention":
        (lambda q, k: (q[:, :, None, :] * k[:, None, :, :]).sum(-1), [(3, 7, 8), (3, 6, 8)]),
    "kept dimensions in the other order (the right operand's first)":
        (lambda q, k: (q[:, None, :, :] * k[:, :, None, :]).sum(-1), [(3, 7, 8), (3, 6, 8)]),
    "summed in the middle, kept as 1 (the MoE weights' gradient)":
        (lambda g, x: (g.unsqueeze(-1).expand_as(x) * x).sum(2, keepdim=True),
         [(2, 5, 6), (2, 5, 6, 4)]),
    "a matrix times a vector, the vector of lower rank":
        (lambda x, v: (x * v).sum(-1), [(9, 6), (6,)]),
    "the contracted dimension first in one operand":
        (lambda a, b: (a.unsqueeze(-1) * b.unsqueeze(1)).sum(0), [(6, 5), (6, 3)]),
}


@pytest.mark.parametrize("name", list(CONTRACTIONS))
def test_a_broadcasting_product_summed_is_one_matmul_with_eagers_values(name):
    function, shapes = CONTRACTIONS[name]
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*shape, generator=generator) for shape in shapes]
    traced, gm, fired = _rewritten(function, *inputs)
    assert fired == 1
    assert aten.matmul.default in _targets(gm) and aten.mul.Tensor not in _targets(gm)
    for seed in range(3):  # other values, and other sizes of the first dimension (a symbol)
        generator = torch.Generator().manual_seed(seed)
        grown = [torch.randn(shape[0] + seed, *shape[1:], generator=generator)
                 if len(shape) > 1 else torch.randn(*shape, generator=generator)
                 for shape in shapes]
        expected = function(*grown)
        torch.testing.assert_close(gm(*grown), expected, rtol=1e-5, atol=1e-6)
        assert gm(*grown).shape == traced(*grown).shape


@pytest.mark.parametrize("special", [float("inf"), float("nan")])
def test_a_contraction_over_values_not_finite_is_not_finite_where_eagers_is(special):
    """inf * 0 is NaN in a matmul's sums as in eager's: the same elements are not finite."""
    function, shapes = CONTRACTIONS["experts mixed (the dense MoE forward)"]
    _, gm, fired = _rewritten(function, *[torch.randn(*shape) for shape in shapes])
    assert fired == 1
    x, w = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    x[1, 2, 3, 0] = special
    w[0, 4, 1] = 0.0
    x[0, 4, 5, 1] = float("inf")  # times a zero weight: NaN in eager's sum
    expected = function(x, w)
    got = gm(x, w)
    assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any()
    assert torch.equal(got.isinf(), expected.isinf())
    kept = expected.isfinite()
    torch.testing.assert_close(got[kept], expected[kept], rtol=1e-5, atol=1e-6)


LEFT_ALONE = {
    "no broadcast (a row's dot product: ORT runs it at memory speed)":
        (lambda a, b: (a * b).sum(-1), [(4, 6), (4, 6)]),
    "two dimensions contracted":
        (lambda a, b: (a * b.unsqueeze(1)).sum((-1, -2)), [(3, 4, 5, 6), (3, 5, 6)]),
    "summed where one operand alone has the dimension":
        (lambda a, b: (a * b.unsqueeze(1)).sum(1), [(3, 4, 6), (3, 6)]),
    "a batch dimension after the matrix ones (a transpose, not a view)":
        (lambda a, b: (a * b.unsqueeze(1)).sum(0), [(6, 5, 3), (6, 3)]),
    "float64":
        (lambda x, w: (x * w.unsqueeze(-2)).sum(-1), [(2, 5, 6, 4), (2, 5, 4)]),
}


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_products_that_are_not_one_matmul_stay_as_they_are(name):
    function, shapes = LEFT_ALONE[name]
    dtype = torch.float64 if name == "float64" else torch.float32
    inputs = [torch.randn(*shape, dtype=dtype) for shape in shapes]
    traced, gm, fired = _rewritten(function, *inputs)
    assert fired == 0 and str(gm.graph) == str(traced.graph)


def test_a_broadcasting_product_read_by_selects_is_each_selects_product():
    """`stack`'s backward picks each expert's part of `grad.unsqueeze(-1) * weights`: each part
    is the product of the operands' parts (a broadcast operand's only element), the same values
    bit for bit, and the whole product is never made."""
    def picked(g, w):
        product = g.unsqueeze(-1).expand(2, 5, 6, 4) * w.unsqueeze(-2)
        return [product.select(-1, i) for i in range(4)]

    g, w = torch.randn(2, 5, 6), torch.randn(2, 5, 4)
    w[1, 1, 2] = float("inf")
    traced, gm, fired = _rewritten(picked, g, w)
    assert fired == 1
    assert aten.expand.default not in _targets(gm)
    assert all(list(node.args[0].meta["val"].shape) != [2, 5, 6, 4]
               for node in gm.graph.nodes if node.target is aten.mul.Tensor)
    for got, expected in zip(gm(g, w), picked(g, w)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_a_product_read_by_other_ops_too_is_made_as_written():
    def read_twice(g, w):
        product = g.unsqueeze(-1) * w.unsqueeze(-2)
        return product.select(-1, 0), product.sum()

    traced, gm, fired = _rewritten(read_twice, torch.randn(3, 4), torch.randn(3, 2))
    assert fired == 0 and str(gm.graph) == str(traced.graph)


def test_a_dense_moe_layer_trains_like_eager_through_ort(fired):
    """The experts' outputs stacked along the last dimension, mixed by the router's weights:
    the forward's mixing and the backward's weight gradient are matmuls, the experts' gradients
    the selects' products; over changing batches (a symbol), the aux loss on some steps."""
    torch.manual_seed(0)
    eager = MoELayer(hidden=16, experts=4)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, batch in enumerate([3, 3, 5, 2]):
        x = torch.randn(batch, 7, 16)
        outputs = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            out, aux = model(x)
            loss = out.pow(2).mean() + (0.01 * aux if step % 2 else 0)
            loss.backward()
            outputs.append((out, aux))
        assert_close(outputs[1][0], outputs[0][0], f"step {step}: output")
        assert_close(outputs[1][1], outputs[0][1], f"step {step}: aux loss")
        assert_grads_equal(lazy, eager, f"step {step}")
    assert ran_through_ort(list(outputs[1]))
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.builds >= 2
    # Each build: the forward's mixing; the backward's weight gradient and experts' parts.
    assert [count for count in fired if count] == [1, 2] * stats.builds


class BroadcastAttention(torch.nn.Module):
    """Attention written with broadcasting instead of matmuls (`(q[:, :, None] * k[:, None])
    .sum(-1)`): both products and their gradients are contractions, some of an operand read
    transposed."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1) / q.shape[-1] ** 0.5
        weights = scores.softmax(-1)
        return (weights.unsqueeze(-1) * v.unsqueeze(1)).sum(2)


def test_attention_written_with_broadcasts_trains_like_eager_through_ort(fired):
    torch.manual_seed(0)
    eager = BroadcastAttention()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, length in enumerate([5, 5, 9, 3]):  # the length becomes a symbol
        last = squares_step_like_eager(lazy, eager, (torch.randn(2, length, 8),), f"step {step}")
    assert ran_through_ort([last]) and lazygrad.stats(lazy).fallbacks == 0
    # Each build: the forward's two products; the backward's four.
    assert [count for count in fired if count] == [2, 4] * lazygrad.stats(lazy).builds
