"""The backward graph is built once per grad mask and reused; the statistics say so."""

from __future__ import annotations

import functools
import math
import sys
import types
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import (
    MODEL_CASES,
    assert_close,
    compose_loss,
    lazy_copy,
    reference_vjp,
    squares_step_like_eager,
    sum_step_like_eager,
)

import lazygrad
from lazygrad import runtime


def _train_step(model, inputs, mask):
    outputs = model(*inputs)
    model.zero_grad(set_to_none=True)
    compose_loss(outputs, mask, [torch.ones_like(o) for o in outputs]).backward()
    return outputs


def test_ten_steps_with_one_mask_give_one_miss_and_nine_hits():
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    for _ in range(10):
        _train_step(lazy, inputs, (True, False, False))
    stats = lazygrad.stats(lazy)
    assert (stats.misses, stats.hits) == (1, 9)
    assert stats.hit_rate == 0.9
    used = [e for e in stats.entries if e.mask == (True, False, False)]
    assert len(used) == 1 and used[0].hits == 9 and used[0].build_seconds > 0


def test_alternating_two_masks_for_twenty_steps_builds_two_graphs():
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    masks = [(True, True, True), (True, False, False)]
    for step in range(20):
        _train_step(lazy, inputs, masks[step % 2])
    stats = lazygrad.stats(lazy)
    assert stats.builds == 2
    assert (stats.misses, stats.hits) == (2, 18)
    assert sorted(e.hits for e in stats.entries) == [9, 9]


def test_alternating_two_partial_masks_builds_those_two_graphs_and_no_other():
    """The first step runs eagerly and builds for the mask its backward shows: no graph is built
    for a mask nobody used (the previous design planned the first stash with all outputs)."""
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    masks = [(False, True, False), (True, False, True)]
    for step in range(20):
        _train_step(lazy, inputs, masks[step % 2])
    stats = lazygrad.stats(lazy)
    assert stats.builds == 2 and stats.misses == 2 and stats.hits == 18
    assert {e.mask for e in stats.entries} == set(masks)
    assert stats.eager_steps == 1


def test_moe_aux_loss_every_third_step_builds_two_graphs_not_one_per_step():
    model, (x,) = MODEL_CASES["moe"]()
    lazy = lazy_copy(model)
    for step in range(12):
        out, aux = lazy(x)
        loss = out.pow(2).mean() + (0.01 * aux if step % 3 == 0 else 0)
        lazy.zero_grad(set_to_none=True)
        loss.backward()
    stats = lazygrad.stats(lazy)
    assert stats.builds == 2
    assert {e.mask for e in stats.entries} == {(True, True), (True, False)}
    assert stats.misses == 2 and stats.hits == 10


def test_a_new_mask_after_many_steps_is_a_miss_with_correct_gradients():
    model, inputs = MODEL_CASES["bert"]()
    lazy = lazy_copy(model)
    for _ in range(3):
        _train_step(lazy, inputs, (False, False, True))  # NSP only: a small stash
    mask = (True, True, False)  # needs the MLM head's intermediates: recomputed
    outputs = lazy(*inputs)
    cotangents = [torch.randn_like(o) for o in outputs]
    lazy.zero_grad(set_to_none=True)
    compose_loss(outputs, mask, cotangents).backward()
    _, expected, _ = reference_vjp(model, inputs, mask, cotangents)
    for name, p in lazy.named_parameters():
        if p.grad is not None:
            assert_close(p.grad, expected[name], name)
    stats = lazygrad.stats(lazy)
    assert stats.misses == 2 and stats.recomputes == 1


def test_cache_size_evicts_least_recently_used_and_counts_evictions():
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model, cache_size=2)
    for mask in [(True, False, False), (False, True, False), (True, False, False),
                 (False, False, True)]:
        _train_step(lazy, inputs, mask)
    stats = lazygrad.stats(lazy)
    cached = {e.mask for e in stats.entries}
    assert cached == {(True, False, False), (False, False, True)}  # (0,1,0) was least recent
    assert stats.evictions == 1


def test_reset_stats_keeps_graphs_and_clear_cache_drops_them():
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    for _ in range(3):
        _train_step(lazy, inputs, (True, False, False))
    lazygrad.reset_stats(lazy)
    _train_step(lazy, inputs, (True, False, False))
    stats = lazygrad.stats(lazy)
    assert (stats.hits, stats.misses, stats.builds) == (1, 0, 0)
    lazygrad.clear_cache(lazy)
    _train_step(lazy, inputs, (True, False, False))
    stats = lazygrad.stats(lazy)
    # Gone from memory: served again from the on-disk cache, through its index (no trace)
    assert (stats.disk_hits, stats.builds, stats.eager_steps) == (1, 0, 0)


def test_stats_is_a_snapshot_that_prints_a_table():
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    _train_step(lazy, inputs, (True, False, False))
    snapshot = lazygrad.stats(lazy)
    _train_step(lazy, inputs, (True, False, False))
    assert snapshot.hits == 0 and lazygrad.stats(lazy).hits == 1
    text = str(lazygrad.stats(lazy))
    assert "hit_rate=50.0%" in text and "100" in text


class SetUpOnFirstCall(torch.nn.Module):
    """Sets a flag at its first forward (as Hugging Face models install their output hooks) and
    counts its calls; the count scales the output on every 3rd call."""

    def __init__(self, counting: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.counting = counting
        self.set_up = False
        self.calls = 0

    def forward(self, x):
        self.set_up = True
        if self.counting:
            self.calls += 1
            return self.linear(x) * (2.0 if self.calls % 3 == 0 else 1.0)
        return self.linear(x)


def _steps_like_eager(counting: bool, steps: int) -> lazygrad.Stats:
    torch.manual_seed(0)
    eager = SetUpOnFirstCall(counting)
    lazy = lazy_copy(eager, wait_for_builds=True)
    x = torch.randn(5, 6)
    for step in range(steps):
        sum_step_like_eager(lazy, eager, (x,), f"step {step}")
        assert (lazy.set_up, lazy.calls) == (eager.set_up, eager.calls)
    return lazygrad.stats(lazy)


def test_a_first_call_that_sets_up_the_module_builds_for_the_module_as_set_up():
    stats = _steps_like_eager(counting=False, steps=4)
    # The first call changed the signature (its flag): no trace for the old one. The second,
    # the first with the flag set, runs eagerly and builds; the other two run through ORT.
    assert (stats.exports, stats.builds, stats.disk_hits) == (1, 1, 0)
    assert (stats.eager_steps, stats.hits, stats.fallbacks) == (2, 2, 0)


def test_a_module_that_counts_its_calls_runs_in_parts_and_says_so_once():
    """Its own code runs eagerly, as each call's count is a signature of its own; its Linear,
    whose attributes do not change, through ORT (before, the whole module ran eagerly)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", lazygrad.GraphBreakWarning)
        stats = _steps_like_eager(counting=True, steps=5)
    # Two calls that changed its attributes, then in parts: the Linear's first call builds.
    assert (stats.builds, stats.eager_steps, stats.fallbacks, stats.breaks) == (0, 2, 0, 1)
    assert (stats.parts["linear"].builds, stats.parts["linear"].hits) == (1, 2)
    said = [str(w.message) for w in caught if issubclass(w.category, lazygrad.GraphBreakWarning)]
    assert len(said) == 1 and "attributes (calls)" in said[0]
    assert stats.reasons[0] in said[0]


class SetUpOverTwoCalls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.stage = 0

    def forward(self, x):
        self.stage = min(self.stage + 1, 2)
        return self.linear(x)


@pytest.mark.falls_back  # in parts while set up
def test_a_set_up_over_two_calls_runs_in_parts_until_done_then_whole_through_ort():
    torch.manual_seed(0)
    eager = SetUpOverTwoCalls()
    lazy = lazy_copy(eager, wait_for_builds=True)
    x = torch.randn(5, 6)
    for step in range(6):
        sum_step_like_eager(lazy, eager, (x,), f"step {step}")
    stats = lazygrad.stats(lazy)
    # Two changing calls, one in parts that changes nothing, then the set-up model's first
    # call builds and the next two run whole through ORT.
    assert (stats.exports, stats.hits, stats.fallbacks, stats.breaks) == (1, 2, 0, 1)


class CountsItsCalls(torch.nn.Module):
    """No submodules: nothing to run in parts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x @ self.weight * (2.0 if self.calls % 3 == 0 else 1.0)


@pytest.mark.falls_back
def test_a_module_without_parts_that_counts_its_calls_runs_eagerly_and_says_so_once():
    torch.manual_seed(0)
    eager = CountsItsCalls()
    lazy = lazy_copy(eager, wait_for_builds=True)
    x = torch.randn(5, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", lazygrad.FallbackWarning)
        for step in range(4):
            sum_step_like_eager(lazy, eager, (x,), f"step {step}")
            assert lazy.calls == eager.calls
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.eager_steps, stats.hits, stats.fallbacks) == (0, 4, 0, 1)
    said = [str(w.message) for w in caught if issubclass(w.category, lazygrad.FallbackWarning)]
    assert len(said) == 1 and "attributes (calls)" in said[0]
    assert said[0].endswith(stats.reasons[0])


class KeepsItsScores(torch.nn.Module):
    """Keeps its last attention scores for a look later, as visualisation code does (and
    RecurrentGemma its recurrent states)."""

    def __init__(self) -> None:
        super().__init__()
        self.query = torch.nn.Linear(6, 6)
        self.key = torch.nn.Linear(6, 6, bias=False)  # a bias softmax cancels: no gradient
        self.scores = None

    def forward(self, x):
        scores = (self.query(x) @ self.key(x).T).softmax(-1)
        self.scores = scores.detach()
        return scores @ x


class AttentionThenHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = KeepsItsScores()
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.attention(x))


def test_a_module_that_keeps_a_tensor_of_each_call_is_captured_with_it():
    """A tensor attribute set at every call was a signature per call (the whole model ran
    eagerly, then in parts down to the module that sets it). Two calls in a row that change
    tensor attributes alone make them results of each call: graphs are captured with them,
    and each ORT step writes eager's tensor to the module."""
    torch.manual_seed(0)
    eager = AttentionThenHead()
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step in range(6):
        x = torch.randn(5, 6)
        sum_step_like_eager(lazy, eager, (x,), f"step {step}")
        assert torch.allclose(lazy.attention.scores, eager.attention.scores, atol=1e-6), step
    stats = lazygrad.stats(lazy)
    # Two calls that changed the scores, one that builds, then three through ORT.
    assert (stats.hits, stats.fallbacks, stats.breaks, stats.eager_steps) == (3, 0, 0, 3)
    assert stats.parts == {}


class KeepsItsLastTrainingOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        out = self.linear(x)
        if self.training:
            self.last = out.detach()
        return out


def test_a_call_that_leaves_a_written_attribute_as_it_was_makes_it_part_of_the_signature():
    """Graphs captured with the attribute as a result would write back the value it had at
    the trace (a stale training output) at every eval call. The eval call that leaves it as
    it was makes it part of the signature again: eval is captured without it, and the
    attribute stays eager's; training adopts it again."""
    torch.manual_seed(0)
    eager = KeepsItsLastTrainingOutput()
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step in range(4):
        sum_step_like_eager(lazy, eager, (torch.randn(2, 4),), f"step {step}")
    kept = lazy.last
    for model in (lazy, eager):
        model.eval()
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(2, 4)
            assert_close(lazy(x), eager(x), f"eval call {call}")
            assert lazy.last is kept, call
    for model in (lazy, eager):
        model.train()
    for step in range(4, 8):
        sum_step_like_eager(lazy, eager, (torch.randn(2, 4),), f"step {step}")
        assert_close(lazy.last, eager.last, f"step {step} last")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0), stats.reasons
    inference = [entry for entry in stats.entries if entry.mask is None]
    assert len(inference) == 1 and inference[0].hits == 1
    assert stats.hits == 3  # steps 3, 6 and 7 (two eager calls adopt the attribute again)


class Settings:
    """A plain object of settings that the forward reads at every call (a Hugging Face config)."""

    def __init__(self) -> None:
        self.scale = 1.0


class ReadsSettings(torch.nn.Module):
    shift = 0.0  # a class attribute: a trace bakes it in

    def __init__(self) -> None:
        super().__init__()
        self.settings = Settings()
        self.inner = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.gain = torch.ones(4)  # a plain tensor attribute: a trace bakes it in
        self.order = [0, 1, 2, 3]  # a list of indices, and a dict of tensors: the same
        self.scales = {"inner": torch.ones(4)}
        self.act = torch.tanh  # functions held: which one is part of the graph
        self.slope = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.1)
        self.temperature = np.exp(0.0)  # NumPy values: a scalar, and an array baked in
        self.weights = np.ones(4, dtype=np.float32)

    def forward(self, x):
        h = self.act(self.inner(x))[:, self.order] * self.scales["inner"]
        h = self.slope(h) / self.temperature * torch.from_numpy(self.weights)
        return self.head(h * self.settings.scale * self.gain + self.shift)


class _ClassAttribute:
    """Sets a class attribute of ReadsSettings; `remove` puts it back."""

    def __init__(self, name: str, value: object) -> None:
        self.name, self.saved = name, getattr(ReadsSettings, name)
        setattr(ReadsSettings, name, value)

    def remove(self) -> None:
        setattr(ReadsSettings, self.name, self.saved)


def _doubled(module, args, output):
    return output * 2


def _summed_weight(self, x):
    return self.weight.sum() + x


CHANGES = {
    "a forward hook added on a submodule":
        lambda m: m.inner.register_forward_hook(_doubled),
    "a forward pre-hook added on a submodule":
        lambda m: m.head.register_forward_pre_hook(lambda module, args: (args[0] + 1,)),
    "a setting changed on a held object": lambda m: setattr(m.settings, "scale", 3.0),
    "a submodule's forward replaced on the instance":
        lambda m: setattr(m.inner, "forward", types.MethodType(_summed_weight, m.inner)),
    "a plain tensor attribute replaced": lambda m: setattr(m, "gain", torch.full((4,), 3.0)),
    "a plain tensor attribute changed in place": lambda m: m.gain.mul_(3.0),
    "an item of a list attribute replaced": lambda m: m.order.__setitem__(1, 3),
    "a list attribute replaced": lambda m: setattr(m, "order", [3, 2, 1, 0]),
    "a tensor in a dict attribute changed in place": lambda m: m.scales["inner"].mul_(3.0),
    "a tensor in a dict attribute replaced":
        lambda m: m.scales.__setitem__("inner", torch.full((4,), 3.0)),
    "a class attribute reassigned": lambda m: _ClassAttribute("shift", 0.5),
    "a function attribute replaced": lambda m: setattr(m, "act", torch.sigmoid),
    "a partial attribute replaced": lambda m: setattr(m, "slope", functools.partial(
        torch.nn.functional.leaky_relu, negative_slope=0.5)),
    "a NumPy scalar attribute replaced": lambda m: setattr(m, "temperature", np.exp(-1.0)),
    "a NumPy array attribute changed in place": lambda m: m.weights.__setitem__(1, 3.0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_the_build_is_traced_again_not_served_stale(change):
    """Each of these once kept serving the graph traced before it, with other values and
    gradients and no reason given (the list, dict and class attributes until later: 2.9, 6.0
    and 8.4 off in probes; the functions and NumPy values until 2026-12-07: 0.03-0.9 off); now
    each is part of the signature."""
    torch.manual_seed(0)
    eager = ReadsSettings()
    lazy = lazy_copy(eager)
    handles = {}
    for step in range(5):
        if step == 3:
            handles = {id(m): CHANGES[change](m) for m in (eager, lazy)}
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"{change}, step {step}")
    assert lazygrad.stats(lazy).hits == 3  # one before the change, one after its rebuild...
    for handle in handles.values():  # ... and a removed hook is seen too
        if hasattr(handle, "remove"):
            handle.remove()
    sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"{change} removed")
    assert lazygrad.stats(lazy).fallbacks == 0


TEMPERATURE = 1.0  # a module-level value the forward below reads, as a training script's


class ReadsAGlobal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x) / TEMPERATURE)


def test_a_module_level_value_the_forward_reads_is_part_of_the_signature(monkeypatch):
    """A trace makes `TEMPERATURE` a constant of the graph: reassigned at run time, it served
    the old graph, silently wrong. Now the value is read at every call (`code_globals.py`)."""
    torch.manual_seed(0)
    eager = ReadsAGlobal()
    lazy = lazy_copy(eager)
    for step in range(5):
        if step == 3:
            monkeypatch.setitem(globals(), "TEMPERATURE", 0.25)
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 3, 0)


def _halved(x: torch.Tensor) -> torch.Tensor:
    return x / 2


ACTIVATION = torch.tanh  # a module-level function the forward calls, as a script's `--act`
GRADIENT_SCALE = 1.0  # read by a custom autograd Function's backward only


class ScalesItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * GRADIENT_SCALE


class CallsGlobals(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return ScalesItsGradient.apply(ACTIVATION(self.linear(x)))


@pytest.mark.parametrize("change", [("ACTIVATION", _halved), ("GRADIENT_SCALE", -3.0)])
def test_a_global_function_replaced_or_a_global_a_custom_backward_reads_is_seen(
        change, monkeypatch):
    """A module-level function the forward calls, replaced by the script after a build, and a
    module-level number that a custom `autograd.Function`'s backward reads, changed: both
    served the old graph, silently (0.65 and 1.0 off in probes): a function was not watched,
    and a helper class's code was not read for the globals it names."""
    torch.manual_seed(0)
    eager = CallsGlobals()
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step in range(5):
        if step == 3:
            monkeypatch.setitem(globals(), *change)
        squares_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 3, 0)


class SumsItsKeywords(torch.nn.Module):
    """Its result depends on the order of its keyword arguments, and on a zero's sign."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, sign=0.0, **weights):
        h = self.linear(x) * math.copysign(1.0, sign)
        for index, weight in enumerate(weights.values()):
            h = h * weight + index
        return h


def test_keyword_order_and_a_zeros_sign_are_part_of_the_signature():
    """Calls that differ in their keywords' order, or in 0.0 against -0.0, were one signature
    (keywords were sorted; -0.0 == 0.0): the second was served the first's graph, 1.15 off."""
    torch.manual_seed(0)
    eager = SumsItsKeywords()
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step, (sign, names) in enumerate([(0.0, "ab"), (0.0, "ab"), (0.0, "ba"), (-0.0, "ba"),
                                          (-0.0, "ba")]):
        weights = {name: {"a": 0.5, "b": 2.0}[name] for name in names}
        x = torch.randn(3, 4)
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(x, sign, **weights), eager(x, sign, **weights)
        assert_close(got.detach(), want.detach(), f"step {step}: output")
        got.square().sum().backward()
        want.square().sum().backward()
        for a, b in zip(lazy.parameters(), eager.parameters()):
            assert_close(a.grad, b.grad, f"step {step}: gradient")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (3, 2, 0), str(stats)


class MakesTensors(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return self.linear(x) * torch.tensor(0.5)


def test_the_default_dtype_is_part_of_the_signature():
    """`torch.tensor(0.5)` is of the default dtype: set to float64 after a build, eager's result
    became float64 and lazygrad's stayed float32."""
    torch.manual_seed(0)
    eager = MakesTensors()
    lazy = lazy_copy(eager, wait_for_builds=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    default = torch.get_default_dtype()
    try:
        for step in range(4):
            if step == 2:
                torch.set_default_dtype(torch.float64)
            sum_step_like_eager(lazy, eager, (x,), f"step {step}")
    finally:
        torch.set_default_dtype(default)
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 2, 0)


class KeepsATrainableTeacher(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.teacher = [torch.nn.Linear(4, 4)]  # outside the tree, and requires grad

    def forward(self, x):
        return self.teacher[0](torch.tanh(self.linear(x)))


@pytest.mark.parametrize("trained", [True, False])
def test_a_module_kept_outside_the_tree_is_refused_with_its_reason(trained):
    """A graph held the teacher's weights as constants: eager gives them gradients (`trained`),
    and an EMA update in place after each step went unseen, silently. Watched by their version
    counters instead, the signature changed at every step and was built anew each time. The
    forward runs it eagerly, its other submodules through ORT."""
    torch.manual_seed(0)
    eager = KeepsATrainableTeacher()
    eager.teacher[0].requires_grad_(trained)
    lazy = lazy_copy(eager, wait_for_builds=True)
    with pytest.warns(lazygrad.GraphBreakWarning, match="kept outside its tree"):
        for step in range(4):
            for model in (lazy, eager):
                model.teacher[0].zero_grad(set_to_none=True)
            squares_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
            if trained:
                assert_close(lazy.teacher[0].weight.grad, eager.teacher[0].weight.grad,
                             f"step {step}: the teacher's gradient")
            for model in (lazy, eager):
                with torch.no_grad():
                    model.teacher[0].weight.mul_(0.9).add_(model.linear.weight, alpha=0.1)
    stats = lazygrad.stats(lazy)
    assert stats.parts["linear"].hits >= 2 and stats.builds == 0


COEFFICIENT = 1.0  # a gradient reversal's coefficient that the script sets at every step


class ReversesGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coefficient):
        ctx.coefficient = coefficient
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.coefficient * grad, None


class Adversarial(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Linear(4, 8)
        self.domain = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.domain(ReversesGradients.apply(torch.tanh(self.features(x)), COEFFICIENT))


def test_a_background_build_never_traces_a_global_the_script_changed_since_its_call(
        monkeypatch):
    """A background trace runs after its call: the script had set the coefficient to its next
    value by then, and the graph filed under one value computed the other's gradients (16 of
    40 steps 0.087 off in a probe, silently). Such a build is dropped, and the signature's
    next call builds again."""
    traced = runtime.capture
    late = []

    def after_the_script_moved_on(*args, **kwargs):
        if not late:  # the first trace runs once the script has set the next value
            late.append(True)
            monkeypatch.setitem(globals(), "COEFFICIENT", 3.0)
        return traced(*args, **kwargs)

    monkeypatch.setattr(runtime, "capture", after_the_script_moved_on)
    torch.manual_seed(0)
    eager = Adversarial()
    lazy = lazy_copy(eager, wait_for_builds=False)  # built in the background, as by default
    x = torch.randn(5, 4)
    for step in range(6):
        monkeypatch.setitem(globals(), "COEFFICIENT", 1.0 if step < 4 else 3.0)
        squares_step_like_eager(lazy, eager, (x,), f"step {step}")
        lazygrad.wait_for_builds(lazy)
    stats = lazygrad.stats(lazy)
    assert late and (stats.builds, stats.hits, stats.fallbacks, stats.breaks) == (2, 3, 0, 0)


CLASS_WEIGHTS = torch.ones(3)  # a module-level tensor the forward reads: a constant of a graph


class WeightedLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.nn.functional.log_softmax(self.linear(x), -1) * CLASS_WEIGHTS


def test_a_module_level_tensor_the_forward_reads_changed_in_place_is_seen():
    """Class weights rebalanced in place by the training script served the old graph, 0.51
    off in a gradient; the tensor's version counter is part of the signature now."""
    torch.manual_seed(0)
    eager = WeightedLoss()
    lazy = lazy_copy(eager)
    saved = CLASS_WEIGHTS.clone()
    try:
        for step in range(5):
            if step == 3:
                CLASS_WEIGHTS.copy_(torch.tensor([1.0, 5.0, 0.1]))
            sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    finally:
        CLASS_WEIGHTS.copy_(saved)
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 3, 0)


class Tempered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, temperature):
        return torch.tanh(self.linear(x) / temperature)


class TemperedLeaf(torch.nn.Module):
    """No submodules: nothing to run in parts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, temperature):
        return torch.tanh(x @ self.weight / temperature)


@pytest.mark.falls_back
@pytest.mark.parametrize("model", [Tempered, TemperedLeaf])
def test_a_number_argument_new_at_every_call_runs_in_parts_or_eagerly_said_once(model):
    """A graph is specialised on each number argument: a temperature annealed at every call
    was a build per step that served no later step, and every step ran eagerly, unsaid. After
    `NUMBER_VALUES` values its new values run without a build, with one warning: in parts
    where the module has parts (its own code, which reads the number, eagerly; its Linear
    through ORT), else eagerly. Values built before still run through ORT."""
    torch.manual_seed(0)
    eager = model()
    lazy = lazy_copy(eager)
    temperatures = [1.0 + 0.1 * step for step in range(runtime.NUMBER_VALUES + 3)] + [1.0, 1.1]
    said = r"argument 1 \('temperature'\) took 8 values"
    in_parts = model is Tempered
    warning = lazygrad.GraphBreakWarning if in_parts else lazygrad.FallbackWarning
    with pytest.warns(warning, match=said) as seen:
        for step, temperature in enumerate(temperatures):
            sum_step_like_eager(lazy, eager, (torch.randn(3, 4), temperature), f"step {step}")
    assert len([w for w in seen if issubclass(w.category, lazygrad.FallbackWarning)]) == 1
    stats = lazygrad.stats(lazy)
    assert (stats.exports, stats.hits) == (runtime.NUMBER_VALUES - 1, 2)
    assert (stats.fallbacks, stats.breaks) == ((0, 1) if in_parts else (1, 0))
    if in_parts:  # the Linear's first call in parts builds, its next ones run through ORT
        assert stats.parts["linear"].builds == 1 and stats.parts["linear"].hits >= 2


CONFIG = {"scale": 2.0, "shift": [0.5, 0.25]}  # a script's settings, read by the forward


class Options:
    def __init__(self) -> None:
        self.temperature = 1.0


OPTIONS = Options()  # as an argparse namespace a script's model reads


class CFG:  # a notebook's settings class, read by its class attributes
    bias = 0.0


class ReadsGlobalSettings(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x) * CONFIG["scale"] + CONFIG["shift"][1] + CFG.bias
        h = h.index_fill(1, torch.tensor(sorted(KEPT)), 0.0)
        return torch.tanh(h / OPTIONS.temperature)


KEPT = {0, 1}  # a script's set of the columns kept


@pytest.mark.parametrize("change", ["dict item", "list item in a dict", "object attribute",
                                    "class attribute", "set item"])
def test_a_global_dict_or_settings_object_changed_in_place_is_seen(change, monkeypatch):
    """A settings dict, object, class or set the forward reads, changed in place by the script
    after a build (the same object: its identity was all that was watched, or a class or a set
    not at all), served the old graph: 1.9 and 0.96 off in outputs, silently. Their contents
    are part of the signature now."""
    monkeypatch.setitem(globals(), "CONFIG", {"scale": 2.0, "shift": [0.5, 0.25]})
    monkeypatch.setitem(globals(), "OPTIONS", Options())
    monkeypatch.setattr(CFG, "bias", 0.0)
    monkeypatch.setitem(globals(), "KEPT", {0, 1})
    torch.manual_seed(0)
    eager = ReadsGlobalSettings()
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step in range(5):
        if step == 3:
            if change == "dict item":
                CONFIG["scale"] = 3.0
            elif change == "list item in a dict":
                CONFIG["shift"][1] = -1.0
            elif change == "object attribute":
                OPTIONS.temperature = 0.5
            elif change == "set item":
                KEPT.add(3)
            else:
                CFG.bias = 1.0
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 3, 0)


def _scaled_by(settings: dict) -> Callable:
    return lambda module, inputs, output: output * settings["scale"]


@pytest.mark.parametrize("when", ["before the first call", "after a build"])
def test_a_setting_a_forward_hook_closes_over_changed_in_place_is_seen(when):
    """A hook scaling an output by a setting it closes over, changed by the script after a
    build, served the old graph: 0.2 off in an output, silently. Its closure's values are part
    of the signature, for hooks registered at any time."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    lazy = lazy_copy(eager, wait_for_builds=True)
    settings = {"scale": 2.0}
    for step in range(6):
        if step == (0 if when == "before the first call" else 2):
            for model in (eager, lazy):
                model[0].register_forward_hook(_scaled_by(settings))
        if step == 4:
            settings["scale"] = 5.0
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 1, stats.reasons
    assert stats.builds == (2 if when == "before the first call" else 3)


gate = torch.ones(4)  # a script's (a notebook's) global, named as the model's attribute


class Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("gate", torch.ones(4))

    def forward(self, x):
        return self.linear(x) * self.gate


def test_a_global_named_as_an_attribute_the_model_reads_is_not_watched(monkeypatch):
    """`self.gate` names an attribute, not the module-level `gate`: watched as a global, a
    script's new tensor under that name at every step made every step a new signature, and the
    model never ran through ORT."""
    torch.manual_seed(0)
    eager = Gated()
    lazy = lazy_copy(eager)
    for step in range(4):
        monkeypatch.setitem(globals(), "gate", torch.randn(4))
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.exports, stats.hits, stats.fallbacks) == (1, 3, 0)


@pytest.mark.falls_back
def test_a_forward_closing_over_the_real_module_is_never_traced_with_its_weights_baked_in():
    """An instance forward that reads a submodule through a closure reads the real parameters
    while a copy of the module's structure is traced: they reached the graph as constants, with
    no gradient (the weight's gradient was missing, silently). Now that submodule runs eagerly,
    with the reason, and the rest of the model through ORT."""
    torch.manual_seed(0)
    eager = ReadsSettings()
    lazy = lazy_copy(eager)
    for m in (eager, lazy):
        m.inner.forward = lambda x, inner=m.inner: inner.weight.sum() + x
    with pytest.warns(lazygrad.FallbackWarning, match="held outside the module's tree"):
        for step in range(4):
            sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    parts = lazygrad.stats(lazy).parts
    assert parts["inner"].fallbacks == 1 and parts["head"].hits > 0


class Progress:
    def __init__(self) -> None:
        self.step = 0


class Run:
    """A trainer's state object handed to the model: its settings, and its progress a level
    down, which the loop bumps at every step."""

    def __init__(self) -> None:
        self.scale = 0.5
        self.progress = Progress()
        self.loss = torch.zeros(())


class HoldsItsRun(torch.nn.Module):
    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.run.scale


def test_a_held_objects_progress_changing_at_every_step_is_not_a_new_signature():
    """The objects and tensors a held settings object holds are not watched: a trainer's
    progress a level down (and a loss it keeps as a tensor), changed at every step, made every
    step a new signature, built and never served (15 builds, 0 hits, in a probe)."""
    torch.manual_seed(0)
    eager = HoldsItsRun(Run())
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step in range(5):
        for model in (lazy, eager):
            model.run.progress.step = step
            model.run.loss.fill_(float(step))
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (1, 4, 0)


class ReadsAnAttributeByName(torch.nn.Module):
    """Reads an attribute the script sets, by its name as a string (no `self.offset` in the
    code)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x) + getattr(self, "offset", 0.0)


def test_what_the_loop_keeps_on_the_model_is_not_a_new_signature_what_the_forward_reads_is():
    """A step counter, a list of losses, a dict of metrics and the last loss kept on the model
    by the training loop, changed at every step: every step was a new signature, run eagerly
    and built, never served (a helper's probe: 80 steps, 0 hits, 16 evictions). No code of the
    model names them, so they are not part of the signature; an attribute the forward reads
    by its name is, set from outside or not."""
    torch.manual_seed(0)
    eager = ReadsAnAttributeByName()
    lazy = lazy_copy(eager, wait_for_builds=True)
    lazy.global_step, lazy.losses, lazy.metrics = 0, [], {}
    for step in range(6):
        if step == 3:
            for model in (lazy, eager):
                model.offset = 0.5
        loss = sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}").sum()
        lazy.global_step += 1
        lazy.losses.append(float(loss))
        lazy.metrics["loss"] = lazy.last_loss = float(loss)
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 4, 0)


def _offset_by_the_script(module, x):
    """Reads an attribute the script sets on the module: named here, not in the model's code."""
    return x + module.offset_set_by_the_script


this_module = sys.modules[__name__]


class CallsAHelperOfAModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return this_module._offset_by_the_script(self, self.inner(x))


def test_an_attribute_a_helper_of_a_user_module_reads_is_part_of_the_signature():
    """`helpers.f(self, x)`: the helper's code is read too, so the attribute it reads, set by the
    script after a build, is part of the signature (not served the old graph)."""
    torch.manual_seed(0)
    eager = CallsAHelperOfAModule()
    lazy = lazy_copy(eager, wait_for_builds=True)
    for step in range(5):
        for model in (lazy, eager):
            model.offset_set_by_the_script = 0.5 if step >= 3 else 0.0
        sum_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks) == (2, 3, 0)
