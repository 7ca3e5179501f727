"""Branches on a tensor's value (`if h.isinf().any():`): taken as the signature's first call took
them, checked at every call, and a call that would take the other branch runs in eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close, assert_grads_equal

import lazygrad


class ClampsNonFinite(torch.nn.Module):
    """DETR's encoder layer's guard: clamp the hidden states only where one is not finite."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.2)
        self.second = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.drop(self.first(x))
        if torch.isinf(h).any() or torch.isnan(h).any():
            big = torch.finfo(h.dtype).max - 1000
            h = h.clamp(min=-big, max=big)
        return self.second(torch.tanh(h))


def _step(model: torch.nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step under `seed`: the output, and torch's generator state after it."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), torch.random.get_rng_state()


def _steps_with_eagers_draws(lazy: torch.nn.Module, eager: torch.nn.Module,
                             inputs: list[torch.Tensor]) -> None:
    """A step of each model per input (`_step`, seeded by its index): the outputs, the
    gradients and torch's generator after the step are eager's."""
    for step, x in enumerate(inputs):
        got, got_generator = _step(lazy, x.clone(), step)
        want, want_generator = _step(eager, x.clone(), step)
        assert_close(got, want, f"output, step {step}")
        assert_grads_equal(lazy, eager, f"step {step}")
        assert torch.equal(got_generator, want_generator), f"generator after step {step}"


def test_a_branch_on_a_value_is_taken_as_the_first_call_took_it_and_checked_every_call():
    """The model ran in parts ("the forward depends on tensor values"). Now the graph takes
    the branch the first call took (no clamp) and returns whether the tensors still agree: a
    call whose hidden state is infinite runs in eager PyTorch, with the Dropout draws eager
    makes (the generator is set back to before the ORT forward's draws)."""
    torch.manual_seed(0)
    eager = ClampsNonFinite()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    inputs = [torch.randn(5, 8) for _ in range(6)]
    inputs[3][0] = 3e38  # overflows to infinity in the first layer
    _steps_with_eagers_draws(lazy, eager, inputs)
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (4, 2)  # the first call, and the overflowing one


class Rescales(torch.nn.Module):
    """Layers that each rescale their input only where it is large: the same line of code
    branches once per layer, each time on another value."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            if x.abs().max() > 10:
                x = x / 10
            x = torch.tanh(layer(x))
        return x


def test_each_layer_takes_its_own_branch_of_the_same_line():
    """The first call branches at one line three times: True for the first layer (a large
    input), False after the tanh. The trace answers each by its place and count, so later
    calls of the same kind run through ORT; a call with a small input (no rescale) runs in
    eager PyTorch."""
    torch.manual_seed(0)
    eager = Rescales()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step, scale in enumerate([100.0, 100.0, 50.0, 1.0, 100.0]):
        x = torch.randn(3, 4) * scale
        got, _ = _step(lazy, x.clone(), step)
        want, _ = _step(eager, x.clone(), step)
        assert_close(got, want, f"output, step {step}")
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 2)  # the first call, and the small input


class TwoHeadsClamp(ClampsNonFinite):
    """`ClampsNonFinite` with a second head, so a second grad mask can be asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.other = torch.nn.Linear(8, 2)

    def forward(self, x):
        return super().forward(x), self.other(x)


def test_a_process_served_from_the_disk_index_builds_a_new_mask_with_the_branches(
        private_disk_cache):
    """The index record keeps the first call's branches: a second model, whose first call the
    index serves through ORT (no eager call to record them), builds its graphs for another mask
    with the same branch taken, instead of running in parts."""
    torch.manual_seed(0)
    eager = TwoHeadsClamp().eval()
    x = torch.randn(5, 8)
    first = lazygrad.lazy(copy.deepcopy(eager))
    for _ in range(2):
        first(x)[0].sum().backward()
    second = lazygrad.lazy(copy.deepcopy(eager))
    for step, which in enumerate([0, 1, 1]):
        for model in (second, eager):
            model.zero_grad(set_to_none=True)
        got, want = second(x), eager(x)
        for index in range(2):
            assert_close(got[index].detach(), want[index].detach(), f"step {step}: {index}")
        got[which].square().sum().backward()
        want[which].square().sum().backward()
        assert_grads_equal(second, eager, f"step {step}")
    stats = lazygrad.stats(second)
    assert (stats.disk_hits, stats.eager_steps, stats.fallbacks, stats.breaks) == (1, 0, 0, 0)


def test_a_branch_that_keeps_going_the_other_way_sends_the_module_to_its_parts():
    """Inputs that alternate between large and small: every other call fails the graph's
    check and runs wholly in eager PyTorch. After 4 such calls (at least a fifth of the calls
    its graph served or missed) the module runs in parts, said once: its own code (the branch)
    eagerly, its layers through ORT. Every step is eager's."""
    torch.manual_seed(0)
    eager = Rescales()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    with pytest.warns(lazygrad.GraphBreakWarning, match=r"failed in 4 of 7 calls"):
        for step in range(14):
            x = torch.randn(3, 4) * (100.0 if step % 2 == 0 else 1.0)
            got, _ = _step(lazy, x.clone(), step)
            want, _ = _step(eager, x.clone(), step)
            assert_close(got, want, f"output, step {step}")
            assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 1)
    assert all(part.hits > 0 for part in stats.parts.values())


class LayerDrop(torch.nn.Module):
    """Hugging Face's LayerDrop: each layer is skipped in training when a uniform draw falls
    under `p`, a branch on a random value."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = torch.tanh(layer(x))
        return x


def test_a_branch_on_a_random_draw_builds_and_replays_eagers_draws():
    """The build's check draws its own numbers, on which a LayerDrop branch may go the other
    way: the build failed ("ChecksFailed") and the model ran in parts. The check now compares
    the graph's check result as any other; each call draws what eager draws, and one that
    skips a layer otherwise than the first call runs eagerly."""
    torch.manual_seed(0)
    eager = LayerDrop(0.1)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    _steps_with_eagers_draws(lazy, eager, [torch.randn(3, 4) for _ in range(12)])
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert stats.hits >= 8 and stats.eager_steps >= 2, stats  # a layer skipped at least once
