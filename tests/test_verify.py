"""The build's check of a selection's indices: a near tie may be ordered either way, a wrong
index is caught."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, assert_grads_equal, sum_step_like_eager
from torch.fx.experimental.proxy_tensor import make_fx

import lazygrad
from lazygrad.verify import VerificationError, _ForwardCheck, _Suspects

aten = torch.ops.aten


def _selections(x: torch.Tensor, image: torch.Tensor):
    pooled, pool_indices = aten.max_pool2d_with_indices(image, [2, 2], [2, 2])
    largest, largest_indices = x.max(dim=1)
    top, top_indices = x.topk(2, dim=1)
    return pooled, pool_indices, largest, largest_indices, top, top_indices, x.argmax()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Each selection's first pick (of the first row, window) has a near tie: a value one
    rounding below it, where another kernel's rounding could have put it above; the second
    has an exact tie."""
    below = 1.0 - 2 ** -23
    x = torch.tensor([[1.0, 0.0, below, -1.0], [0.9, 0.5, 0.9, 0.0]])
    image = torch.zeros(1, 1, 2, 4)
    image[0, 0, 0, 0], image[0, 0, 1, 1] = 1.0, below
    image[0, 0, 0, 3] = image[0, 0, 1, 2] = 2.0
    return x, image


@pytest.mark.parametrize("position, nearly_tied, wrongs", [
    (1, [[[[5, 3]]]], [[[[[4, 3]]]]]),  # max pooling: flat positions in the image's plane
    (3, [2, 0], [[1, 0]]),  # max(dim)
    (5, [[2, 0], [0, 2]], [[[3, 0], [0, 2]]]),  # topk
    (6, 2, [1]),  # argmax of every element
])
def test_indices_of_a_near_tie_pass_and_a_wrong_index_fails(position, nearly_tied, wrongs):
    """ORT's convolution rounds differently from torch's, so a pooling window's two largest
    inputs, a rounding apart, can come out in the other order: a VGG ran in parts for it. Both
    picks are right within rounding, as their values are. An index that picks a value that is
    not the largest is a translation bug and still fails."""
    graph = make_fx(_selections)(*_inputs())
    wanted = list(_selections(*_inputs()))
    assert wanted[position].tolist() != nearly_tied

    for indices, passes in ((nearly_tied, True), *((wrong, False) for wrong in wrongs)):
        got = [t.clone() for t in wanted]
        got[position] = torch.tensor(indices)
        suspects = _Suspects()
        check = _ForwardCheck(graph, got, kept=set(), suspects=suspects)
        if passes:
            check.run(*_inputs())
            suspects.judge(lambda: pytest.fail("no float result differs"))
        else:
            with pytest.raises(VerificationError, match=f"forward result {position}: ORT and "
                                                        "torch differ"):
                check.run(*_inputs())


class ExactTies(torch.nn.Module):
    """Selections over exactly tied values whose pick torch defines (the first): max pooling
    (plain and with ceil_mode), `max(dim)`, `argmax`-gathered values. (`topk` leaves the order
    of ties to its kernel, whose pick on the CPU is not the first: `TiedRouter`.)"""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1, 1, 6, 6))

    def forward(self, x):
        tied = x * self.scale
        pooled = F.max_pool2d(tied, 2) + F.max_pool2d(tied, 3, 2, ceil_mode=True).sum()
        rows = tied.flatten(2)
        largest = rows.max(dim=-1).values
        first = rows.gather(-1, rows.argmax(-1, keepdim=True))
        return pooled.sum() + largest.sum() + first.sum()


def test_ort_takes_the_first_of_an_exact_tie_as_torch_does():
    """The build's check lets a selection's indices differ from torch's where the values they
    pick are equal within the tolerance (a near tie), exact ties included (torch's may be none
    in ORT's); so that ORT's kernels take the first of an exact tie, as torch's, is asserted
    here: the gradient of each tied selection goes where eager's goes."""
    torch.manual_seed(0)
    eager = ExactTies()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.tensor([1.0, 2.0, 2.0]).repeat(12).reshape(1, 1, 6, 6)  # ties in every window
    for step in range(3):
        sum_step_like_eager(lazy, eager, (x,), f"step {step}")
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


class TiedRouter(torch.nn.Module):
    """Routes each row to the experts a selection picks (`PICKS`), weighted by their scores.
    Among exactly equal scores eager's CPU kernels pick in an order of their own
    (`[3, 3, 3, 3].topk(3)` gives indices 2, 3, 0), the trace's ops the lowest index first: a
    call with a tie got other experts, another output and other gradients, with no fallback."""

    def __init__(self, pick: str) -> None:
        super().__init__()
        self.pick = PICKS[pick]
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.experts = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        scores, chosen = self.pick(x * self.scale)
        return (scores * self.experts[chosen]).reshape(len(x), -1).sum(-1), chosen


PICKS = {"topk": lambda scores: scores.topk(3, dim=-1),
         "median": lambda scores: scores.median(-1),  # (lowered: `lowerings.sorted_pick`)
         "kthvalue": lambda scores: torch.kthvalue(scores, 3, -1)}
# Ties at every pick: among the top 3 (first row), at the 3rd-4th of the sorted row (both).
_TIED = torch.tensor([[3.0, 3.0, 3.0, 3.0, 1.0, 0.0, 2.0, 3.0],
                      [0.5, 2.0, 2.0, 1.0, 0.0, 2.0, 0.0, 0.0]])
_NEXT_TIED = torch.tensor([[1.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.0]] * 2)  # past the top 3


def _routed_like_eager(lazy: torch.nn.Module, eager: torch.nn.Module, calls: list[str]) -> None:
    """Steps of `TiedRouter` on the named inputs: experts chosen, output and gradients eager's."""
    inputs = {"distinct": torch.randn(2, 8), "tied": _TIED, "next tied": _NEXT_TIED}
    for step, name in enumerate(calls):
        for module in (lazy, eager):
            module.zero_grad(set_to_none=True)
        (got, got_chosen), (want, want_chosen) = lazy(inputs[name]), eager(inputs[name])
        assert torch.equal(got_chosen, want_chosen), f"step {step} ({name}): experts chosen"
        assert_close(got.detach(), want.detach(), f"step {step} ({name}): output")
        got.sum().backward()
        want.sum().backward()
        assert_grads_equal(lazy, eager, f"step {step} ({name})")


@pytest.mark.parametrize("pick", PICKS)
@pytest.mark.parametrize("calls", [
    "distinct, tied, next tied, distinct",  # ties once the graphs serve: those calls eagerly
    "tied, distinct, distinct, tied",  # a first call with a tie builds nothing
])
def test_a_pick_among_equal_values_runs_eagerly_and_gives_eagers_picks(calls, pick):
    """A top-k's graph checks that its picks and the value after them are all distinct, a
    median's or k-th value's that no other element equals it; a call where they are not runs
    again in eager PyTorch, and a first call with a tie, whose graphs would not compute what it
    computed, leaves the next call to be the first."""
    torch.manual_seed(0)
    eager = TiedRouter(pick)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    steps = calls.split(", ")
    _routed_like_eager(lazy, eager, steps)
    stats = lazygrad.stats(lazy)
    served = steps.count("distinct") - 1  # the first distinct call builds
    assert stats.hits == served and stats.builds == 1, stats
    assert stats.eager_steps == len(steps) - served, stats
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


def test_a_top_k_tied_at_every_call_runs_in_eager_pytorch_with_the_reason_said():
    torch.manual_seed(0)
    eager = TiedRouter("topk")
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with pytest.warns(UserWarning, match=r"picks free of ties\) failed in 4 of 4 calls"
                                         r".*test_verify.py:\d+ picked among equal values"):
        _routed_like_eager(lazy, eager, ["tied"] * 6)
    stats = lazygrad.stats(lazy)
    assert stats.builds == 0 and stats.hits == 0 and stats.fallbacks == 1, stats
