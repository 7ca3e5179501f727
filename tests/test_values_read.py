"""Values read from a tensor in a forward: a branch (`if h.isinf().any():`), a size
(`int(mask.sum(1).max())`), lengths (`.tolist()`). Each is taken as the signature's first call
read it, checked at every call, and a call that would read another runs in eager PyTorch."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import (
    assert_close,
    assert_grads_equal,
    assert_loss_step_like_eager,
    squares_step_like_eager,
)

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


def _step(model: torch.nn.Module, x: torch.Tensor | tuple, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step under `seed` (`x`: the input, or a tuple of them): the output, and torch's
    generator state after it."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(*x) if isinstance(x, tuple) else model(x)
    out.square().sum().backward()
    return out.detach(), torch.random.get_rng_state()


def _steps_like_eager(lazy: torch.nn.Module, eager: torch.nn.Module, inputs: list,
                      generator: bool = False) -> None:
    """A step of each model per input (`_step`, seeded by its index; an input: a tensor, or a
    tuple of them): the outputs and the gradients are eager's, and with `generator` torch's
    generator after the step too."""
    for step, x in enumerate(inputs):
        got, got_generator = _step(lazy, _copied(x), step)
        want, want_generator = _step(eager, _copied(x), step)
        assert_close(got, want, f"output, step {step}")
        assert_grads_equal(lazy, eager, f"step {step}")
        if generator:
            assert torch.equal(got_generator, want_generator), f"generator after step {step}"


def _steps_into_parts(lazy: torch.nn.Module, eager: torch.nn.Module, inputs: list,
                      message: str) -> None:
    """`_steps_like_eager`, in which the module goes to its parts, said once (a
    GraphBreakWarning matching `message`), its layers then through ORT."""
    with pytest.warns(lazygrad.GraphBreakWarning, match=message):
        _steps_like_eager(lazy, eager, inputs)
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 1)
    assert all(part.hits > 0 for part in stats.parts.values())


def _copied(x: torch.Tensor | tuple) -> torch.Tensor | tuple:
    return tuple(map(torch.clone, x)) if isinstance(x, tuple) else x.clone()


def _squares_of(which: int) -> Callable[[Sequence[torch.Tensor]], torch.Tensor]:
    """The loss of `assert_loss_step_like_eager`: the sum of output `which`'s squares."""
    return lambda outputs: outputs[which].square().sum()


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
    _steps_like_eager(lazy, eager, inputs, generator=True)
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
    _steps_like_eager(lazy, eager, [torch.randn(3, 4) * scale
                                    for scale in [100.0, 100.0, 50.0, 1.0, 100.0]])
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
        assert_loss_step_like_eager(second, eager, (x,), f"step {step}", loss=_squares_of(which))
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
    inputs = [torch.randn(3, 4) * (100.0 if step % 2 == 0 else 1.0) for step in range(14)]
    _steps_into_parts(lazy, eager, inputs, r"failed in 4 of 7 calls")


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
    _steps_like_eager(lazy, eager, [torch.randn(3, 4) for _ in range(12)], generator=True)
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert stats.hits >= 8 and stats.eager_steps >= 2, stats  # a layer skipped at least once


class CutsPadding(torch.nn.Module):
    """Cuts the sequence to its longest row, a length read as a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)

    def forward(self, x, mask):
        longest = int(mask.sum(1).max())
        h = torch.tanh(self.first(x[:, :longest]))
        return self.second(h).mean(1)


def _padded(lengths: list[int], seq: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(len(lengths), seq, 8), torch.arange(seq) < torch.tensor(lengths)[:, None]


def test_a_size_read_as_a_number_is_the_first_calls_and_checked_every_call():
    """`int(mask.sum(1).max())` made the trace fail (a size from data), so the module ran in
    parts. The graph now cuts where the first call cut and checks that the mask's longest row
    is as long: calls with the same longest row run through ORT, one with another runs in
    eager PyTorch."""
    torch.manual_seed(0)
    eager = CutsPadding()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step, lengths in enumerate([[3, 7], [7, 5], [2, 7], [4, 9], [7, 7]]):
        squares_step_like_eager(lazy, eager, _padded(lengths), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 2)  # the first call, and the longer row


class PoolsSegments(torch.nn.Module):
    """Attention pooling over segments of its rows, their lengths read as a list (as Qwen2-VL's
    vision attention splits its images' patches by `lengths.tolist()`); a second output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)

    def forward(self, x, starts):
        h = self.first(x)
        segments = torch.split(h, (starts[1:] - starts[:-1]).tolist())
        pooled = torch.stack([s.softmax(0).mul(s).sum(0) for s in segments])
        return self.second(pooled), h[: starts[-1].item()].sum(0)


def test_lengths_read_as_a_list_are_kept_by_the_disk_index(private_disk_cache):
    """The lengths the first call read (a list) are the graph's, checked every call, and the
    index record keeps them: a second model, served from the index from its first call, builds
    its graphs for another grad mask with the same lengths. Other lengths run eagerly."""
    torch.manual_seed(0)
    eager = PoolsSegments()
    starts = torch.tensor([0, 3, 7, 12])
    first = lazygrad.lazy(copy.deepcopy(eager))
    for _ in range(2):
        first(torch.randn(12, 8), starts)[0].sum().backward()
    assert lazygrad.stats(first).hits == 1
    second = lazygrad.lazy(copy.deepcopy(eager))
    for step, (which, ends) in enumerate([(0, starts), (1, starts), (1, starts),
                                          (0, torch.tensor([0, 5, 7, 12]))]):
        assert_loss_step_like_eager(second, eager, (torch.randn(12, 8), ends), f"step {step}",
                                    loss=_squares_of(which))
    stats = lazygrad.stats(second)
    assert (stats.disk_hits, stats.fallbacks, stats.breaks) == (1, 0, 0)
    assert (stats.hits, stats.eager_steps) == (2, 1), stats  # other lengths: eagerly


class ScalesByItsMax(torch.nn.Module):
    """Divides by its hidden state's largest magnitude, read as a Python float."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.first(x)
        return self.second(h / h.detach().abs().max().item())


def test_a_number_read_that_changes_every_call_sends_the_module_to_its_parts():
    """A float read from data differs at every call: each later call fails the graph's check
    and runs eagerly, and after 4 the module runs in parts (its layers through ORT), said once.
    Every step is eager's."""
    torch.manual_seed(0)
    eager = ScalesByItsMax()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    inputs = [torch.randn(3, 8) for _ in range(8)]
    _steps_into_parts(lazy, eager, inputs, r"a number read .* failed in 4 of 4")


class KeepsUnmaskedRows(torch.nn.Module):
    """A masked autoencoder's encoder: it keeps the rows its mask leaves (a fixed number per
    sample, `x[~masked]`) and weighs each by its segment, numbered by `repeat_interleave` of
    the segment lengths (as Qwen2-VL's vision tower numbers its images' patches); a second
    output sums a `masked_select` of one feature and the masked coordinates (`torch.where`
    of one argument, `nonzero`, `argwhere`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.encode = torch.nn.Linear(8, 4)

    def forward(self, x, masked, lengths):
        h = self.embed(x)
        segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        kept = (h[~masked] * (1 + segment[:, None])).reshape(x.shape[0], -1, 8)
        first = torch.masked_select(h[..., 0], masked)
        sample, position = torch.where(masked)
        return (self.encode(torch.tanh(kept)).mean(1),
                first.sum() + (sample * position).sum() + masked.nonzero().sum()
                + masked.argwhere()[:, 1].sum())


def _masked_rows(generator: torch.Generator, masked: int = 9) -> torch.Tensor:
    """(4, 12) booleans, `masked` True in each row, at random places."""
    return torch.rand(4, 12, generator=generator).argsort(1).argsort(1) < masked


def test_lengths_of_selections_from_data_are_the_first_calls_and_checked_every_call():
    """`x[mask]`, `nonzero`, `masked_select`, one-argument `torch.where` and
    `repeat_interleave` by a tensor made the trace fail (an output length from data), so the
    module ran in parts. The graph now selects as many rows as the first call did, wherever
    the data puts them, and checks the count: calls with the same number of masked rows
    (other rows each time) run through ORT, one with another number in eager PyTorch. Every
    step is eager's."""
    torch.manual_seed(0)
    eager = KeepsUnmaskedRows()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 7])  # 4 rows x 3 kept = 12
    for step, masked in enumerate([9, 9, 9, 8, 9]):
        mask = _masked_rows(generator, masked)
        x = torch.randn(4, 12, 8)
        segments = lengths if masked == 9 else torch.tensor([8, 8])
        assert_loss_step_like_eager(lazy, eager, (x, mask, segments), f"step {step}",
                                    loss=_squares_of(0))
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 2)  # the first call, and 8 masked per row


class LanguageAdapters(torch.nn.Module):
    """X-MOD's adapters: each sample's rows go through its language's adapter, picked and
    written back by a boolean mask (`x[mask] = adapter(x[mask])`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.adapters = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, languages):
        h = self.embed(x)
        adapted = torch.zeros_like(h)
        for index, adapter in enumerate(self.adapters):
            mask = languages == index
            adapted[mask] = adapter(h[mask])
        return torch.tanh(adapted + h)


def test_rows_written_back_by_a_mask_get_eagers_gradients():
    """`x[mask] = value` traced with a length from data in its backward (the gradient of
    `value` is the output gradient's `[mask]`), so the module ran in parts. Each language's
    count of rows is each call's (`data_lengths.py`): every call after the first runs through
    ORT, both samples of one language, and none of the other, included."""
    torch.manual_seed(0)
    eager = LanguageAdapters()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    _steps_like_eager(lazy, eager, [(torch.randn(2, 5, 8), torch.tensor(languages))
                                    for languages in [[0, 1], [1, 0], [0, 0], [1, 1]]])
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (3, 1)  # all but the first call


class PoolsByToken(torch.nn.Module):
    """Pools its rows by token id: `unique` with the inverse and the counts (as many distinct
    ids in every batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.mix = torch.nn.Linear(8, 8)

    def forward(self, x, ids):
        tokens, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        h = self.mix(x) + self.embed(tokens)[inverse]
        pooled = torch.zeros(tokens.shape[0], 8).index_add(0, inverse.reshape(-1),
                                                           h.reshape(-1, 8))
        return (pooled / counts[:, None]).tanh(), ids.unique().float()


def _ids(generator: torch.Generator, distinct: int) -> torch.Tensor:
    """(3, 4) token ids, `distinct` of them, each at least once, at random places."""
    chosen = torch.randperm(20, generator=generator)[:distinct]
    picks = torch.cat([chosen, chosen[torch.randint(0, distinct, (12 - distinct,),
                                                    generator=generator)]])
    return picks[torch.randperm(12, generator=generator)].reshape(3, 4)


def test_unique_with_its_inverse_and_counts_is_each_calls_length():
    """`torch.unique` (its inverse and counts too) traced with a length from data: the module
    ran in parts. Its length is each call's (`data_lengths.py`): five distinct ids (other ids,
    other places) and six run through ORT alike."""
    torch.manual_seed(0)
    eager = PoolsByToken()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(2)
    for step, distinct in enumerate([5, 5, 5, 6, 5]):
        assert_loss_step_like_eager(lazy, eager, (torch.randn(3, 4, 8), _ids(generator, distinct)),
                                    f"step {step}", loss=_squares_of(0))
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0)
    assert (stats.hits, stats.eager_steps) == (4, 1)  # all but the first call
