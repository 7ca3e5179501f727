"""Lengths read from data made as each call's data says (`capture/data_lengths.py`): token
routing, whose counts change at every step, runs through ORT; a line whose length the code
branches on or reshapes by is the first call's length, checked."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from conftest import assert_loss_step_like_eager, ran_through_ort

import lazygrad


class TokenRoutedExperts(torch.nn.Module):
    """A Mixture-of-Experts layer as users write it: top-2 routing, each expert run on its own
    tokens (`torch.where` of the routing mask, `x[tokens]`), its results added back by
    `index_add_`, and the Switch Transformer's load-balancing loss as a second output."""

    def __init__(self, hidden: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, 16), torch.nn.SiLU(),
                                torch.nn.Linear(16, hidden))
            for _ in range(experts))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(-1)
        weights, chosen = probs.topk(2, dim=-1)
        out = torch.zeros_like(tokens)
        routed = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        for index, expert in enumerate(self.experts):
            slot, token = torch.where(routed[index])
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        share = F.one_hot(chosen[:, 0], len(self.experts)).float().mean(0)
        aux = len(self.experts) * (share * probs.mean(0)).sum()
        return out.reshape(x.shape), aux


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
    eager = TokenRoutedExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(3)
    counts = set()
    for step, tokens in enumerate([12, 12, 3, 12, 2, 12]):
        x = torch.randn(1, tokens, 8, generator=generator)
        chosen = eager.router(x.reshape(-1, 8)).topk(2, dim=-1).indices
        counts.add(tuple(torch.bincount(chosen.reshape(-1), minlength=4).tolist()))
        assert_loss_step_like_eager(lazy, eager, (x,), f"step {step}", loss=_routed_loss(step))
    assert any(0 in count for count in counts) and len(counts) == 6
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert stats.eager_steps == 2  # the first call of each number of tokens
    assert ran_through_ort(lazy(torch.randn(1, 12, 8)))


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


def test_a_length_the_code_reshapes_by_is_the_first_calls_and_the_others_each_calls():
    """A reshape by a length from data (visible patches per sample) assumes it divides, which
    a graph would not check: that line's length is the first call's, checked (a call with
    another count of masked patches runs in eager PyTorch), while the other line's is each
    call's (the count of loud patches differs at every call)."""
    torch.manual_seed(0)
    eager = KeepsVisiblePatches()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(1)
    louds = set()
    for step, masked in enumerate([9, 9, 9, 8, 9]):
        mask = torch.rand(4, 12, generator=generator).argsort(1).argsort(1) < masked
        x = 2 * torch.randn(4, 12, 8, generator=generator)
        louds.add(int((eager.embed(x).norm(dim=-1) > 2).sum()))
        assert_loss_step_like_eager(lazy, eager, (x, mask), f"step {step}",
                                    loss=lambda outputs: outputs[0].sum() + outputs[1].sum())
    assert len(louds) >= 3
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 2)  # the first call, and 8 masked per row


class SkipsIdleExperts(torch.nn.Module):
    """Routing that skips an expert given no tokens (`if token.shape[0] == 0: continue`)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 3)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token = torch.where(chosen == index)[0]
            if token.shape[0] == 0:
                continue
            out = out.index_add(0, token, expert(x[token]))
        return (out,)


def test_a_branch_on_a_length_makes_that_lines_length_the_first_calls_checked():
    """A branch on a length from data fails a trace that does not know it: that line's
    lengths are the first call's, checked. Calls routing as many tokens to each expert (other
    tokens) run through ORT; one that routes otherwise runs in eager PyTorch."""
    torch.manual_seed(0)
    eager = SkipsIdleExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(9, 8)
    orders = [range(9), range(8, -1, -1), [1, 0, *range(2, 9)]]  # other tokens, same counts
    for step, order in enumerate(orders):
        assert_loss_step_like_eager(lazy, eager, (x[list(order)],), f"step {step}",
                                    loss=lambda outputs: outputs[0].square().sum())
    assert_loss_step_like_eager(lazy, eager, (torch.randn(9, 8),), "other counts",
                                loss=lambda outputs: outputs[0].square().sum())
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (2, 2)


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
