"""Lengths read from data made as each call's data says (`capture/data_lengths.py`): token
routing, whose counts change at every step, runs through ORT; a branch on such a length is
taken as the first call's, checked; what torch assumes of one (that a reshape by it divides) is
checked."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_loss_step_like_eager, ran_through_ort

import lazygrad
from lazygrad.examples.models import RoutedExperts


def _routed_loss(step: int):
    """The task loss, and the auxiliary loss on every other step (the grad mask changes)."""
    def loss(outputs):
        task = outputs[0].square().mean()
        return task + 0.1 * outputs[1] if step % 2 else task
    return loss


def test_token_routing_whose_counts_change_every_step_runs_through_ort():
    """Each expert's count of tokens is data, another at every step: the module ran in parts
    after 4 calls whose checked counts differed, its routing in eager PyTorch. Now each count is
    the call's own (ONNX's NonZero), so every step after the first runs through ORT, with
    eager's outputs and gradients, an expert with no tokens at all included."""
    torch.manual_seed(0)
    eager = RoutedExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(3)
    counts = set()
    for step, tokens in enumerate([12, 12, 3, 12, 2, 12]):
        x = torch.randn(1, tokens, 8, generator=generator)
        chosen = eager.router(x.reshape(-1, 8)).topk(2, dim=-1).indices  # as it routes
        counts.add(tuple(torch.bincount(chosen.reshape(-1), minlength=4).tolist()))
        assert_loss_step_like_eager(lazy, eager, (x,), f"step {step}", loss=_routed_loss(step))
    assert any(0 in count for count in counts) and len(counts) == 6
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert stats.eager_steps == 2  # the first call of each number of tokens
    assert ran_through_ort(lazy(torch.randn(1, 12, 8)))


class SortedExperts(torch.nn.Module):
    """JetMoE's and DeepSeek's reference routing: the tokens sorted by expert and split by each
    expert's count of tokens, read as a list (`torch.split(x, counts.tolist())`)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(experts))

    def forward(self, x):
        chosen = self.router(x).argmax(-1)
        order = chosen.argsort(stable=True)
        counts = (chosen[:, None] == torch.arange(len(self.experts))).sum(0).tolist()
        runs = x[order].split(counts)
        out = torch.cat([expert(run) for expert, run in zip(self.experts, runs)])
        return (torch.zeros_like(x).index_copy(0, order, out),)


def test_integers_read_as_a_list_are_each_calls():
    """Counts read as a list (`tolist()`) and split by: the trace keeps them unknown integers
    (the graph reads each call's), and checks what torch assumed of them (that they sum to
    the number of tokens). Every call after the first runs through ORT, whatever the counts."""
    torch.manual_seed(0)
    eager = SortedExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(5)
    counts = set()
    for step in range(5):
        x = torch.randn(10, 8, generator=generator)
        counts.add(tuple(torch.bincount(eager.router(x).argmax(-1), minlength=3).tolist()))
        assert_loss_step_like_eager(lazy, eager, (x,), f"step {step}",
                                    loss=lambda outputs: outputs[0].square().sum())
    assert len(counts) >= 4
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (4, 1)


class ExpertsByName(torch.nn.ModuleDict):
    """Switch Transformers' and NLLB-MoE's experts: a loop over the experts hit
    (`nonzero()`), each picked by its name (`self[f"expert_{index[0]}"]`) and run on its own
    tokens (`torch.where`)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__({f"expert_{index}": torch.nn.Linear(8, 8) for index in range(experts)})

    def forward(self, h, chosen, probs):
        out = torch.zeros_like(h)
        routed = F.one_hot(chosen, num_classes=len(self)).permute(2, 1, 0)
        hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero()
        for index in hit:
            slot, token = torch.where(routed[index].squeeze(0))
            expert = self[f"expert_{index[0]}"]
            out.index_add_(0, token, expert(h[token]) * probs[token, slot, None])
        return (out,)


def test_experts_picked_by_a_name_made_of_a_tensor_run_through_ort():
    """The loop over the experts hit iterates a length from data (a branch inside torch's
    `unbind`, which the exporter meets again): that line is the first call's, checked; the
    name formatted from a traced index read the tensor's repr (no such expert, so the module
    ran in parts) and now reads its value as eager's `Tensor.__format__` does, checked; each
    expert's tokens stay each call's. Calls hitting the same experts run through ORT."""
    torch.manual_seed(0)
    eager = ExpertsByName()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(6)
    for step in range(4):
        chosen = torch.cat([torch.arange(3), torch.randint(0, 3, (7,), generator=generator)])
        inputs = (torch.randn(10, 8, generator=generator), chosen[:, None],
                  torch.rand(10, 1, generator=generator))
        assert_loss_step_like_eager(lazy, eager, inputs, f"step {step}",
                                    loss=lambda outputs: outputs[0].square().sum())
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 1)


class KeepsVisiblePatches(torch.nn.Module):
    """VideoMAE's encoder input: the visible patches, as many in every sample, reshaped by the
    batch (`x[~mask].reshape(batch, -1, hidden)`); and a pooling over the patches whose norm is
    large, as many as the data says."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.encode = torch.nn.Linear(8, 8)

    def forward(self, x, masked):
        h = self.embed(x)
        visible = h[~masked].reshape(x.shape[0], -1, 8)
        loud = h[h.norm(dim=-1) > 2]
        return self.encode(visible).tanh(), loud.square().sum(0)


def test_what_a_reshape_assumes_of_a_length_from_data_is_checked_at_every_call():
    """A reshape by a length from data (the visible patches of each sample) assumes that the
    length divides, which torch would assert at run time: the graph checks it. Calls with
    other counts of masked patches (each sample as many) and of loud patches run through ORT;
    one whose visible patches do not divide runs in eager PyTorch, which raises eager's
    error."""
    torch.manual_seed(0)
    eager = KeepsVisiblePatches()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(1)
    louds = set()
    for step, masked in enumerate([9, 9, 8, 9]):
        mask = torch.rand(4, 12, generator=generator).argsort(1).argsort(1) < masked
        x = 2 * torch.randn(4, 12, 8, generator=generator)
        louds.add(int((eager.embed(x).norm(dim=-1) > 2).sum()))
        assert_loss_step_like_eager(lazy, eager, (x, mask), f"step {step}",
                                    loss=lambda outputs: outputs[0].sum() + outputs[1].sum())
    assert len(louds) >= 3
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 1)
    mask[0, mask[0].nonzero()[0]] = False  # one more visible patch: 13 in all
    for model in (eager, lazy):
        with pytest.raises(RuntimeError, match="invalid for input of size 104"):
            model(x, mask)


class SkipsIdleExperts(torch.nn.Module):
    """Routing that skips an expert given no tokens (`if token.shape[0] == 0: continue`); its
    router sends each token to the largest of its first three features."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        chosen = x[:, :3].argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token = torch.where(chosen == index)[0]
            if token.shape[0] == 0:
                continue
            out = out.index_add(0, token, expert(x[token]))
        return (out,)


def _routed_to(experts: list[int], generator: torch.Generator) -> torch.Tensor:
    """Tokens (one per entry of `experts`) that `SkipsIdleExperts` sends to those experts."""
    x = torch.randn(len(experts), 8, generator=generator)
    x[torch.arange(len(experts)), experts] = 10.0
    return x


def test_a_branch_on_a_length_is_taken_as_the_first_calls_and_checked():
    """A branch on a length from data fails a trace that does not know the length: it is
    answered with the first call's length (every expert given tokens), and the graph checks
    that the call's length takes the same branch. Calls with other counts of tokens, none 0,
    run through ORT; one that gives an expert none runs in eager PyTorch."""
    torch.manual_seed(0)
    eager = SkipsIdleExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(4)
    routes = [[0, 1, 2, 0, 1], [1, 1, 2, 0, 0], [2, 1, 0, 0, 0], [0, 2, 2, 1, 1], [0, 0, 2, 2, 2]]
    for step, experts in enumerate(routes):
        assert_loss_step_like_eager(lazy, eager, (_routed_to(experts, generator),),
                                    f"step {step}", loss=lambda outputs: outputs[0].square().sum())
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 2)  # the first call, and expert 1 idle


class SelectsRows(torch.nn.Module):
    """Returns the rows a mask selects, as many as the data says, transformed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return (self.linear(x[mask]).tanh(), torch.masked_select(x, mask[..., None]).sum())


def test_an_output_as_long_as_the_data_says_none_included():
    """An output whose length is data: each call's, none included, through ORT."""
    torch.manual_seed(0)
    eager = SelectsRows()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(2)
    for step, share in enumerate([0.5, 0.2, 0.0, 0.9]):
        x = torch.randn(3, 6, 8, generator=generator)
        mask = torch.rand(3, 6, generator=generator) < share
        assert_loss_step_like_eager(lazy, eager, (x, mask), f"step {step}",
                                    loss=lambda outputs: outputs[0].square().sum() + outputs[1])
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 1)
