"""One exported graph and one backward graph per mask serve every batch size and sequence length."""

from __future__ import annotations

import copy

import torch
from conftest import assert_close, compose_loss, lazy_copy, reference_vjp, sum_step_like_eager

import lazygrad
from lazygrad.examples.models import BertConfig, BertPretraining, MoELayer, bert_batch

# (batch, sequence length); sizes 1 are traced as constants (they broadcast): a batch of one is
# a signature of its own, tested with the other size-dependent cases in test_capture.py.
SHAPES = [(2, 8), (3, 12), (5, 5), (4, 20), (2, 33)]


def test_five_sequence_lengths_and_batch_sizes_build_twice_per_mask():
    """The first shapes get graphs for their exact sizes (as torch.compile specialises a first
    compilation); at the first change the sizes become symbols, and one graph per mask serves
    every later shape."""
    torch.manual_seed(0)
    config = BertConfig(vocab=200, hidden=32, layers=2, heads=4, max_positions=64)
    model = BertPretraining(config)
    lazy = lazy_copy(model)
    masks = [(True, False, False), (True, True, False)]
    for step, (batch, seq) in enumerate(SHAPES):
        inputs = bert_batch(config, batch=batch, seq=seq, seed=step)
        for mask in masks:
            outputs = lazy(*inputs)
            assert outputs[1].shape == (batch, seq, config.vocab)
            cotangents = [torch.randn_like(o) for o in outputs]
            expected_outputs, expected_grads, _ = reference_vjp(model, inputs, mask, cotangents)
            for index, (got, want) in enumerate(zip(outputs, expected_outputs)):
                assert_close(got.detach(), want, f"{(batch, seq)} output {index}")
            lazy.zero_grad(set_to_none=True)
            compose_loss(outputs, mask, cotangents).backward()
            for name, param in lazy.named_parameters():
                assert_close(param.grad, expected_grads[name], f"{(batch, seq)} {mask} {name}")
    stats = lazygrad.stats(lazy)
    assert stats.exports == 2  # exact sizes, then symbols
    assert stats.fallbacks == 0
    assert stats.misses == 2 * len(masks)  # one build per mask and signature, then hits
    assert stats.hits == len(SHAPES) * len(masks) - 2 * len(masks)
    built = [(entry.forward, entry.mask) for entry in stats.entries]
    assert len(built) == len(set(built)), "a mask was built twice"
    assert {mask for _, mask in built} == set(masks)


def test_a_rank_change_is_a_new_signature_a_size_change_makes_sizes_symbols():
    torch.manual_seed(1)
    model = MoELayer(hidden=8, experts=3)
    lazy = lazy_copy(model)
    eager = copy.deepcopy(model)
    for shape in [(2, 5, 8), (3, 7, 8), (4, 6, 8), (4, 8), (9, 8), (5, 8)]:
        x = torch.randn(shape)
        lazy.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        out, aux = lazy(x)
        out_eager, aux_eager = eager(x)
        assert_close(out.detach(), out_eager.detach(), f"{shape} out")
        assert_close(aux.detach(), aux_eager.detach(), f"{shape} aux")
        (out.sum() + 0.1 * aux).backward()
        (out_eager.sum() + 0.1 * aux_eager).backward()
        for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"{shape} {name}")
    stats = lazygrad.stats(lazy)
    assert stats.exports == 4  # rank 3 exact, then with symbols; rank 2 the same
    # Each signature's first step runs eagerly and builds its one mask at its backward; the
    # third shape of each rank is served by the graphs with symbols.
    assert stats.builds == 4 and stats.misses == 4 and stats.hits == 2


class BakedSize(torch.nn.Module):
    """`torch.tensor(x.shape[0])` is a constant of the trace: the graph holds for one size only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * torch.tensor(x.shape[0], dtype=torch.float32)


def test_a_trace_that_bakes_sizes_in_is_exported_once_per_size_and_stays_exact():
    torch.manual_seed(0)
    eager = BakedSize()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for batch in (2, 3, 2):
        x = torch.randn(batch, 4)
        for m in (lazy, eager):
            m.zero_grad(set_to_none=True)
        out, expected = lazy(x), eager(x)
        assert_close(out.detach(), expected.detach(), f"output at batch {batch}")
        out.sum().backward()
        expected.sum().backward()
        assert_close(lazy.linear.weight.grad, eager.linear.weight.grad, f"grad at batch {batch}")
    stats = lazygrad.stats(lazy)
    assert (stats.exports, stats.fallbacks) == (2, 0)


class PositionTables(torch.nn.Module):
    """Keeps a position table per sequence length in a dict keyed by the length: with the
    length a symbol the trace fails (a symbol is no dict key), for the exact length it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.tables = {n: torch.sin(torch.arange(n * 8.0).reshape(n, 8)) for n in (6, 9)}

    def forward(self, x):
        return torch.tanh(self.proj(x) + self.tables[x.shape[1]])


def test_a_trace_that_fails_on_symbolic_sizes_is_done_for_each_exact_size():
    """It ran in parts before (its Linear alone through ORT, the rest eagerly), with a tracing
    failure as its reason; now each length gets graphs of its own."""
    torch.manual_seed(0)
    eager = PositionTables()
    lazy = lazy_copy(eager)
    for step, length in enumerate((6, 6, 6, 9, 9, 6)):
        sum_step_like_eager(lazy, eager, (torch.randn(2, length, 8),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks, stats.exports) == (0, 0, 2)
    assert stats.hits == 3  # the first call of each length runs eagerly and builds


class SpanOfTheLength(torch.nn.Module):
    """Slices a position table by `torch.tensor(min(length, span))`, as DeBERTa does."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Parameter(torch.randn(64, 8))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        span = torch.tensor(min(x.size(1), 32))
        return self.proj(x) @ self.positions[0: span * 2, :].t()


def test_a_size_made_a_tensor_and_read_back_is_a_size_not_data():
    """The trace's decomposition of `torch.tensor` made the span unknown data: the module ran
    in parts ("depends on tensor values"). Now each length is exact through ORT."""
    torch.manual_seed(0)
    eager = SpanOfTheLength()
    lazy = lazy_copy(eager)
    for step, length in enumerate((6, 6, 9, 9, 40, 40, 6)):
        sum_step_like_eager(lazy, eager, (torch.randn(2, length, 8),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert stats.hits == 4


def test_only_the_sizes_a_call_changes_become_symbols():
    """A batch of images of one size: the batch becomes a symbol at its first change, the
    channels, height and width stay exact (a trace with them as symbols costs Swin's window
    arithmetic minutes)."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
                                torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 2))
    lazy = lazy_copy(eager)
    for step, batch in enumerate((2, 2, 3, 4, 2)):
        sum_step_like_eager(lazy, eager, (torch.randn(batch, 3, 16, 16),), f"step {step}")
    shapes = {signature.shapes for signature, _ in lazygrad.api.runtime_of(lazy)._pairs}
    assert shapes == {((2, 3, 16, 16),), ((None, 3, 16, 16),)}
    stats = lazygrad.stats(lazy)
    assert stats.hits == 3 and stats.fallbacks == 0 and stats.breaks == 0
