"""The forward stashes for the mask its backward will bring: cycles followed, odd masks cheap."""

from __future__ import annotations

import copy

import torch
from conftest import assert_close, assert_grads_equal

import lazygrad
from lazygrad.forecast import MaskForecast

A, B, C = (True, False), (False, True), (True, True)


def _misses(masks: list[tuple[bool, ...]], per_step: int = 1) -> list[int]:
    """Which calls the forecast planned wrongly, for backwards that bring `masks` in call order;
    `per_step` forwards run before their backwards, which come in reverse order."""
    forecast, missed = MaskForecast(), []
    for start in range(0, len(masks), per_step):
        calls = [forecast.next_call() for _ in masks[start:start + per_step]]
        plans = [forecast.plan(call) for call in calls]
        for call, plan in reversed(list(zip(calls, plans))):
            if plan != masks[call]:
                missed.append(call)
            forecast.record(call, masks[call])
    return missed


def test_an_auxiliary_loss_every_4th_step_misses_only_while_its_cycle_is_learnt():
    masks = [A, A, A, B] * 10
    # The first call has no history. The first aux step misses, and the one after it (a new
    # mask is taken to stay); the second aux step misses: the cycle has not repeated yet.
    assert _misses(masks) == [0, 3, 4, 7]


def test_a_cycle_of_16_calls_is_followed_and_a_longer_one_is_not_mistaken_for_it():
    assert _misses(([A] * 15 + [B]) * 6) == [0, 15, 16, 31]
    # A cycle of 20: the first call, the call after the first B, then each B.
    assert _misses(([A] * 19 + [B]) * 6) == [0, 19, 20, 39, 59, 79, 99, 119]


def test_a_mask_that_joins_on_odd_steps_costs_one_miss_not_two():
    masks = [A] * 70
    for odd in (5, 25, 40, 41, 62):
        masks[odd] = B
    # The call after the first B misses (a new mask is taken to stay); after that, only each B
    # itself, as it joins: the plan after a B is the A that has followed it.
    assert _misses(masks) == [0, 5, 6, 25, 40, 41, 62]


def test_a_change_for_good_costs_one_miss():
    assert _misses([A] * 10 + [B] * 10 + [C] * 10) == [0, 10, 20]


def test_two_calls_per_step_backwards_in_reverse_order_follow_the_calls():
    # Until the cycle of 2 has repeated, the latest mask (the first call's, B) is taken to stay.
    assert sorted(_misses([A, B] * 10, per_step=2)) == [0, 1, 2]


class AuxLossLayer(torch.nn.Module):
    """An output and an auxiliary loss, each with its own parameters and intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(12, 24)
        self.router = torch.nn.Linear(12, 4)

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        return torch.tanh(self.body(x)), (probs.mean(0) * probs.logsumexp(-1).mean()).sum()


def test_a_model_with_an_aux_loss_every_4th_step_stops_recomputing_once_the_cycle_is_learnt():
    torch.manual_seed(0)
    eager = AuxLossLayer()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(8, 12)
    recomputes = []
    for step in range(16):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(x), eager(x)
        for index, (a, b) in enumerate(zip(got, want)):
            assert_close(a.detach(), b.detach(), f"step {step}: output {index}")
        for out, aux in (got, want):
            (out.pow(2).mean() + (0.1 * aux if step % 4 == 3 else 0)).backward()
        assert_grads_equal(lazy, eager, f"step {step}")
        recomputes.append(lazygrad.stats(lazy).recomputes)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.builds == 2
    # The first step runs eagerly. Then steps 3 and 7 (the aux loss before its cycle has
    # repeated) and step 4 (the aux mask taken to stay) recompute; none after.
    assert recomputes == [0, 0, 0, 1, 2, 2, 2, 3] + [3] * 8
