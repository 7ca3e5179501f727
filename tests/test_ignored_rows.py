"""A loss's ignored rows left out of its backward's products (capture/ignored_rows.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lazygrad
from lazygrad.capture import ignored_rows, node_maker, peephole
from tests import test_mixed_precision
from tests.conftest import assert_close, assert_grads_equal, counted_rewrites
from tests.test_peephole import _decomposed, _total

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def few_classes_too(monkeypatch):
    """These tests' heads have tens of classes, where a vocabulary has thousands."""
    monkeypatch.setattr(ignored_rows, "CLASSES_AT_LEAST", 2)


@pytest.fixture
def fired(monkeypatch) -> list[int]:
    """What each of the rewrite's calls rewrote, in order (the builds' backward graphs)."""
    return counted_rewrites(monkeypatch, ignored_rows)


@pytest.fixture
def fired_forward(monkeypatch) -> list[int]:
    """What each call of the forward's rewrite rewrote, in order (the builds' forward graphs)."""
    return counted_rewrites(monkeypatch, ignored_rows, "rewrite_forward")


def _head_backward(logits, target, grad, total, weight, hidden):
    """Cross-entropy's gradient through a head `hidden @ weight.t() + bias`: the gradients of
    its input, weight and bias, as the partition leaves them."""
    out = aten._log_softmax.default(logits, 1, False)
    nll = aten.nll_loss_backward.default(grad, out, target, None, 1, -100, total)
    g = aten._log_softmax_backward_data.default(nll, out, 1, logits.dtype)
    return g.mm(weight), g.t().mm(hidden), g.view(2, -1, g.shape[1]).sum([0, 1], keepdim=True)


def _inputs(rows: int, classes: int, dim: int, seed: int, ignored: float = 0.75):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[torch.rand(rows, generator=generator) < ignored] = -100
    return (torch.randn(rows, classes, generator=generator), target, torch.tensor(0.7),
            _total(target), torch.randn(classes, dim, generator=generator),
            torch.randn(rows, dim, generator=generator))


def _rewritten(fn, inputs: tuple) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """`fn` traced and rewritten by the peephole rules, then by ignored_rows with `inputs`'
    targets as the first call's: (before ignored_rows, after it, how many it rewrote)."""
    gm = _decomposed(fn, *inputs)
    peephole.rewrite(gm)
    dense = copy.deepcopy(gm)
    return dense, gm, ignored_rows.rewrite(gm, lambda node: {"target_1": inputs[1]}.get(node.name))


def test_the_kept_rows_alone_give_the_gradients_of_every_row():
    dense, gm, fired = _rewritten(_head_backward, _inputs(8, 11, 5, 0))
    assert fired == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.nonzero.default in targets and aten.index_put.default in targets
    for seed in range(4):  # other sizes, other targets (none ignored, all ignored): symbolic
        rows = 2 * (3 + seed)
        inputs = _inputs(rows, 9 + seed, 4, seed, ignored=(0.75, 0.0, 1.0, 0.5)[seed])
        for got, expected in zip(gm(*inputs), dense(*inputs), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        logits = inputs[0].clone().requires_grad_()  # and eager's, through autograd
        F.cross_entropy(logits, inputs[1], ignore_index=-100).mul(0.7).backward()
        eager = (logits.grad @ inputs[4], logits.grad.t() @ inputs[5], logits.grad.sum(0))
        for got, expected in zip(gm(*inputs), eager, strict=True):
            torch.testing.assert_close(got.view_as(expected), expected, rtol=1e-5, atol=1e-6)
        ignored = inputs[1] == -100
        if ignored.any() and not ignored.all():
            assert torch.equal(gm(*inputs)[0][ignored], torch.zeros_like(inputs[5][ignored]))


def test_an_ignored_row_that_overflowed_gives_eagers_nan_gradients():
    """Eager's gradient is NaN wherever an ignored row's logits are not finite (0 * inf):
    then every row is computed, and the NaN reaches the products as in eager."""
    dense, gm, fired = _rewritten(_head_backward, _inputs(8, 11, 5, 0))
    assert fired == 1
    inputs = _inputs(8, 11, 5, 1)
    ignored = int((inputs[1] == -100).nonzero()[0])
    inputs[0][ignored, 3] = float("inf")
    for got, expected in zip(gm(*inputs), dense(*inputs), strict=True):
        assert expected.isnan().any()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)


def _head_backward_with_another_term(logits, target, grad, total, weight, hidden, other):
    """`_head_backward` where another term of the loss reads the logits too (its gradient
    `other`, as large as them), added to cross-entropy's before the head's products."""
    out = aten._log_softmax.default(logits, 1, False)
    nll = aten.nll_loss_backward.default(grad, out, target, None, 1, -100, total)
    g = aten._log_softmax_backward_data.default(nll, out, 1, logits.dtype)
    g = aten.add.Tensor(other, g.view(2, -1, g.shape[1])).view(-1, g.shape[1])
    return g.mm(weight), g.t().mm(hidden)


@pytest.mark.parametrize("overflow", [False, True])
def test_another_terms_gradient_gets_the_kept_rows_added_to_it(overflow):
    """Only the kept rows' softmax is computed and added to the other term's gradient; where an
    ignored row is not finite every row is, and the NaN reaches the products as in eager."""
    def inputs(seed, rows=8, classes=11):
        generator = torch.Generator().manual_seed(100 + seed)
        other = torch.randn(2, rows // 2, classes, generator=generator)
        return (*_inputs(rows, classes, 5, seed), other)

    dense, gm, fired = _rewritten(_head_backward_with_another_term, inputs(0))
    assert fired == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten._softmax.default in targets and aten.index_put.default in targets
    for seed in range(3):
        found = inputs(seed, rows=2 * (3 + seed), classes=9 + seed)
        if overflow:
            found[0][int((found[1] == -100).nonzero()[0]), 3] = float("inf")
        for got, expected in zip(gm(*found), dense(*found), strict=True):
            assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any() == overflow
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
        logits = found[0].clone().requires_grad_()  # and eager's, through autograd
        (F.cross_entropy(logits, found[1], ignore_index=-100).mul(0.7)
         + (logits * found[6].view_as(logits)).sum()).backward()
        eager = (logits.grad @ found[4], logits.grad.t() @ found[5])
        for got, expected in zip(gm(*found), eager, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("every_row", ["exp", "added to itself"])
def test_a_reader_other_than_a_product_or_sum_leaves_the_graph_as_it_is(every_row):
    def fn(logits, target, grad, total, weight, hidden):
        out = aten._log_softmax.default(logits, 1, False)
        nll = aten.nll_loss_backward.default(grad, out, target, None, 1, -100, total)
        g = aten._log_softmax_backward_data.default(nll, out, 1, logits.dtype)
        if every_row == "exp":
            return g.mm(weight), g.exp()  # every row of g read
        return aten.add.Tensor(g.view(2, -1, g.shape[1]), g.view(2, -1, g.shape[1])).sum(0)

    dense, gm, fired = _rewritten(fn, _inputs(8, 11, 5, 0))
    assert fired == 0 and str(gm.graph) == str(dense.graph)


def test_a_rewrite_that_fails_half_way_leaves_the_graph_as_it_was(monkeypatch):
    """An op the picking did not expect fails while its nodes are made: they are erased, so
    the graph stays dense (the model is not run in parts for an optimisation)."""
    def failing(*args, **kwargs):
        raise RuntimeError("an op this rewrite did not expect")

    monkeypatch.setattr(node_maker.Maker, "size", failing)  # after a dozen nodes are made
    dense, gm, fired = _rewritten(_head_backward, _inputs(8, 11, 5, 0))
    assert fired == 0 and str(gm.graph) == str(dense.graph)


def test_a_head_of_few_classes_is_left_as_it_is(monkeypatch):
    """A sentence pair's two classes, a tagger's labels: the picking would cost more than it
    saves."""
    monkeypatch.setattr(ignored_rows, "CLASSES_AT_LEAST", 12)
    dense, gm, fired = _rewritten(_head_backward, _inputs(8, 11, 5, 0))
    assert fired == 0 and str(gm.graph) == str(dense.graph)


def test_a_loss_that_keeps_most_rows_is_left_as_it_is():
    """Picking most rows would cost a copy of the logits for little: a causal LM's labels."""
    dense, gm, fired = _rewritten(_head_backward, _inputs(8, 11, 5, 0, ignored=0.25))
    assert fired == 0 and str(gm.graph) == str(dense.graph)


def _label_log_probabilities(logits, target):
    """Cross-entropy's forward as the capture decomposes it (pick, negate, zero the ignored)."""
    return aten.nll_loss_forward.default(aten._log_softmax.default(logits, 1, False), target,
                                         None, 1, -100)[0]


def _decomposed_forward(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    gm = _decomposed(fn, *inputs)
    gm.graph.eliminate_dead_code()  # as the partition leaves a forward
    return gm


def test_the_forward_picks_the_kept_rows_log_probabilities_alone():
    """The label's log-probability of every kept row, the ignored rows' zeroed, computed from
    the kept rows' log-softmax alone: the loss bit for bit, over other sizes and other shares
    (every row kept, none), and eager's where an ignored row's logits are not finite."""
    logits, target = _inputs(8, 11, 5, 0)[:2]
    gm = _decomposed_forward(_label_log_probabilities, logits, target)
    assert ignored_rows.rewrite_forward(gm, lambda node: {"target_1": target}.get(node.name)) == 1
    log_softmax_rows = [n.meta["val"].shape[0] for n in gm.graph.nodes
                        if n.target is aten._log_softmax.default]
    assert len(log_softmax_rows) == 1 and not isinstance(log_softmax_rows[0], int)  # the count
    for seed in range(4):
        rows = 2 * (3 + seed)
        logits, target = _inputs(rows, 9 + seed, 4, seed, ignored=(0.75, 0.0, 1.0, 0.5)[seed])[:2]
        if seed == 3:
            logits[(target == -100).nonzero()[0]] = float("inf")
        expected = _label_log_probabilities(logits, target)
        assert expected.isfinite() or seed == 2  # every row ignored: 0 / 0, eager's NaN
        torch.testing.assert_close(gm(logits, target), expected, rtol=0, atol=0, equal_nan=True)


def test_a_forward_whose_first_call_kept_most_rows_or_whose_pick_is_read_elsewhere_stays():
    logits, target = _inputs(8, 11, 5, 0, ignored=0.25)[:2]
    gm = _decomposed_forward(_label_log_probabilities, logits, target)
    assert ignored_rows.rewrite_forward(gm, lambda node: {"target_1": target}.get(node.name)) == 0

    def also_read(logits, target):  # an ignored row's pick reaches the result
        picked = aten._log_softmax.default(logits, 1, False).gather(1, target.clamp(min=0)[:, None])
        return picked.sum()

    logits, target = _inputs(8, 11, 5, 0)[:2]
    gm = _decomposed_forward(also_read, logits, target)
    assert ignored_rows.rewrite_forward(gm, lambda node: {"target_1": target}.get(node.name)) == 0


class MaskedLanguageModel(torch.nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, labels, features=None):
        h = self.embed(ids) if features is None else features
        logits = self.head(torch.relu(self.hidden(h)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), logits


def _batch(batch: int, seq: int, generator: torch.Generator):
    ids = torch.randint(0, 50, (batch, seq), generator=generator)
    labels = torch.where(torch.rand(batch, seq, generator=generator) < 0.15, ids, -100)
    return ids, labels


@pytest.mark.parametrize("trains_logits", [False, True])
def test_a_masked_language_model_trains_like_eager_over_changing_batches(trains_logits, fired,
                                                                        fired_forward):
    """Only the loss trained: its ignored rows are skipped; the logits trained too (their
    gradient dense, read by the same products): the loss's rows are still computed alone and
    added into it. Batches of other sizes and other masked counts (one with every row masked,
    which the graph built on a few serves)."""
    torch.manual_seed(0)
    eager = MaskedLanguageModel()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, lazy)]
    generator = torch.Generator().manual_seed(1)
    for step, batch in enumerate([4, 4, 3, 5, 5, 2]):
        ids, labels = _batch(batch, 12, generator)
        if step == 4:
            labels = ids
        results = []
        for model in (eager, lazy):
            loss, logits = model(ids, labels)
            (loss + (logits.pow(2).mean() if trains_logits else 0)).backward()
            results.append((loss, logits))
        assert_close(results[1][0], results[0][0], f"step {step}: loss")
        assert_close(results[1][1], results[0][1], f"step {step}: logits")
        assert_grads_equal(lazy, eager, f"step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits >= 4
    # Both builds, the batch a symbol in the second (its labels' view sized from it).
    assert fired == [1, 1]
    assert fired_forward == [1, 1]


def _steps_up_to_an_overflow(eager: torch.nn.Module, steps: int, seed: int,
                             loss_of) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """`steps` steps of `eager` and a lazy copy, the last with an ignored row's features
    infinite: the losses eager's, every gradient eager's, NaN where eager's is. The lazy model
    and eager's losses."""
    torch.manual_seed(0)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    generator = torch.Generator().manual_seed(seed)
    eager_losses = []
    for step in range(steps):
        ids, labels = _batch(3, 10, generator)
        labels[0, 0], labels[1, 1] = -100, 7
        features = torch.randn(3, 10, 16, generator=generator)
        if step == steps - 1:
            features[0, 0] = float("inf")  # the row's logits overflow; its label is ignored
        losses = []
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            losses.append(loss_of(model(ids, labels, features)))
            losses[-1].backward()
        assert_close(losses[1], losses[0], f"step {step}: loss")
        for (name, p), q in zip(eager.named_parameters(), lazy.parameters(), strict=True):
            if p.grad is None:  # the embedding, which the features replace
                assert q.grad is None, f"step {step}: {name}"
                continue
            assert torch.equal(p.grad.isnan(), q.grad.isnan()), f"step {step}: {name}"
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, equal_nan=True)
        eager_losses.append(losses[0])
    assert eager.head.weight.grad.isnan().any()
    return lazy, eager_losses


def test_an_overflow_in_an_ignored_row_gives_eagers_nan_gradients_through_ort(fired_forward):
    torch.manual_seed(0)
    lazy, losses = _steps_up_to_an_overflow(MaskedLanguageModel(), 3, 2, lambda out: out[0])
    assert not any(loss.isnan() for loss in losses)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2
    assert fired_forward == [1]  # the forward's log-softmax skipped the overflowed row


def test_autocast_gradients_of_the_kept_rows_are_as_close_to_float64_as_eagers(fired):
    """Under autocast the gradient reaches the head's products through a cast to float16, which
    the picked rows are given too. (In `.half()` the backward of a float16 log-softmax computes
    in float32 between casts, which the peephole rules leave as it is: nothing is skipped.)"""
    test_mixed_precision._trains_as_eager(test_mixed_precision._bert, "autocast", torch.float16,
                                          "cpu")
    assert any(fired)


class CausalLanguageModel(MaskedLanguageModel):
    """Labels shifted in the forward, as Hugging Face's causal-LM loss does."""

    def forward(self, ids, labels):
        logits = self.head(torch.relu(self.hidden(self.embed(ids))))
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100), logits


@pytest.mark.parametrize("prompt_masked", [True, False])
def test_labels_shifted_in_the_forward_are_read_as_the_first_call_made_them(prompt_masked,
                                                                           fired):
    """A fine-tuning's prompt masked out (-100 on most positions): the rows are picked; every
    position labelled (one ignored a sequence, the shift's): the graph stays dense."""
    torch.manual_seed(0)
    eager = CausalLanguageModel()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    generator = torch.Generator().manual_seed(3)
    for step in range(3):
        ids = torch.randint(0, 50, (3, 12), generator=generator)
        labels = ids.clone()
        if prompt_masked:
            labels[:, :8] = -100
        for model in (eager, lazy):
            model.zero_grad(set_to_none=True)
            model(ids, labels)[0].backward()
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2
    assert fired == [1 if prompt_masked else 0]


class LossOnly(MaskedLanguageModel):
    """Returns the loss alone, summed: the backward reads the forward's saved log-softmax (the
    logits are not kept), whose exponent gives the probabilities."""

    def forward(self, ids, labels, features):
        logits = self.head(torch.relu(self.hidden(features)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / 7


def test_a_loss_whose_log_softmax_is_saved_skips_its_rows_and_keeps_eagers_nan(fired):
    torch.manual_seed(0)
    lazy, _ = _steps_up_to_an_overflow(LossOnly(), 4, 4, lambda loss: loss)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 3
    assert fired == [1]


def _from_log_probabilities(log_p, target, grad, total, weight, hidden):
    """The backward of a loss whose log-probabilities the forward saved, in the form the
    peephole rules leave: `scatter_add(exp(l) * -r, 1, i, r)`."""
    kept = (target != -100).unsqueeze(1)
    r = torch.where(kept, grad / total, 0) * -1.0
    index = torch.where(kept, target.unsqueeze(1), 0)
    g = torch.scatter_add(log_p.exp() * -r, 1, index, r)
    return g.mm(weight), g.t().mm(hidden)


def test_an_exponent_that_overflows_in_an_ignored_row_gives_the_dense_nan():
    """exp(l) of a large l is infinite, times the row's zero weight NaN, as in eager: the check
    holds the exponent of the largest l too, not only the sum's finiteness."""
    dense, gm, fired = _rewritten(_from_log_probabilities, _inputs(8, 11, 5, 0))
    assert fired == 1
    inputs = _inputs(8, 11, 5, 2)
    ignored = int((inputs[1] == -100).nonzero()[0])
    inputs[0][ignored, 4] = 100.0  # finite, but exp(100) is not
    for got, expected in zip(gm(*inputs), dense(*inputs), strict=True):
        assert expected.isnan().any()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    inputs[0][ignored, 4] = 1.0
    for got, expected in zip(gm(*inputs), dense(*inputs), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
