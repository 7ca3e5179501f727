"""A lazy module is still the user's module: class, state, modes, copies, optimizers, hooks."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import assert_close, assert_grads_equal, sum_step_like_eager

import lazygrad
from lazygrad.capture import forward_hooks
from lazygrad.examples.models import ThreeHeadMLP


@lazygrad.lazy
class LazyMLP(ThreeHeadMLP):
    """A subclass decorated at definition: every instance is lazy."""

    def forward(self, x):
        return super().forward(x)


@lazygrad.lazy(policy="all", cache_size=8)
class LazyWithOptions(ThreeHeadMLP):
    def forward(self, x):
        return super().forward(x)


def _reference(model: torch.nn.Module) -> ThreeHeadMLP:
    plain = ThreeHeadMLP()
    plain.load_state_dict(model.state_dict())
    return plain


def _assert_same_training_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    eager = _reference(model)
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
        a, b, _ = m(x)
        (a.sum() + b.square().mean()).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert_close(p.grad, q.grad, name)


def test_class_decorator_keeps_isinstance_and_runs_lazily():
    torch.manual_seed(0)
    model = LazyMLP()
    assert isinstance(model, LazyMLP) and isinstance(model, ThreeHeadMLP)
    _assert_same_training_step(model, torch.randn(4, 16))
    assert lazygrad.stats(model).misses == 1


def test_decorator_with_arguments_applies_its_options():
    model = LazyWithOptions()
    model(torch.randn(2, 16))[0].sum().backward()
    runtime_options = lazygrad.api.runtime_of(model).options
    assert (runtime_options.policy, runtime_options.cache_size) == ("all", 8)


def test_instance_wrapper_keeps_state_dict_parameters_and_modules():
    plain = ThreeHeadMLP()
    keys = list(plain.state_dict())
    params = list(plain.parameters())
    modules = [name for name, _ in plain.named_modules()]
    model = lazygrad.lazy(plain)
    assert model is plain and type(model) is ThreeHeadMLP
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert [name for name, _ in model.named_modules()] == modules


def test_train_and_eval_get_their_own_graphs_and_eval_still_differentiates_like_eager():
    """As in eager PyTorch, eval mode changes what the modules compute, not whether autograd
    records: eval-mode outputs carry gradients (a frozen-BatchNorm fine-tune needs them)."""
    torch.manual_seed(0)
    model = LazyMLP()
    x = torch.randn(3, 16)
    for mode in ("eval", "train"):
        getattr(model, mode)()
        for _ in range(2):  # the second step runs through ORT
            _assert_same_training_step(model, x)
        assert type(model(x)[0].grad_fn).__name__ == "LazyFunctionBackward"
    with torch.no_grad():
        out = model.eval()(x)[0]
    assert out.grad_fn is None and not out.requires_grad
    assert_close(out, _reference(model).eval()(x)[0].detach(), "eval output")
    assert lazygrad.stats(model).exports == 3  # train, eval, and eval without grad


class AttendsThenScores(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.score = torch.nn.Linear(32, 5)

    def forward(self, x, padding):
        attended, weights = self.attention(x, x, x, key_padding_mask=padding)
        return self.score(attended), weights


def test_multihead_attention_in_eval_under_no_grad_runs_whole_through_ort():
    """Its fast path in eval under no_grad makes the next Linear's output a view of a tensor
    nothing else holds, which the traced path does not: "the trace and eager disagree on
    which outputs share memory", and the model ran in parts."""
    torch.manual_seed(0)
    eager = AttendsThenScores().eval()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(3, 10, 32)
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[1, 7:] = True
    with torch.no_grad():
        for call in range(3):
            for got, expected in zip(lazy(x, padding), eager(x, padding), strict=True):
                assert_close(got, expected, f"call {call}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 0 and stats.fallbacks == 0
    assert [entry.hits for entry in stats.entries] == [2]


def test_no_grad_gives_plain_tensors():
    model = LazyMLP()
    with torch.no_grad():
        outputs = model(torch.randn(2, 16))
    assert all(o.grad_fn is None for o in outputs)


def test_deepcopy_and_pickle_give_working_lazy_models_with_their_own_stats():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    for model in (LazyMLP(), lazygrad.lazy(ThreeHeadMLP())):
        model(x)[0].sum().backward()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
        for clone in copies:
            assert lazygrad.stats(clone).misses == 0
            assert clone.state_dict().keys() == model.state_dict().keys()
            _assert_same_training_step(clone, x)
            assert lazygrad.stats(clone).misses == 1
            assert clone.regress.weight is not model.regress.weight


def test_optimizer_steps_are_seen_by_the_next_forward():
    torch.manual_seed(0)
    model = LazyMLP()
    eager = _reference(model)
    x = torch.randn(8, 16)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for _ in range(3):
        for m, opt in zip((model, eager), opts):
            opt.zero_grad()
            m(x)[1].square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p.detach(), q.detach(), "parameter after 3 SGD steps")


def test_tensor_hooks_and_module_hooks_fire_once_per_call():
    model = LazyMLP()
    seen = []
    model.regress.weight.register_hook(lambda g: seen.append(("grad", g.shape)))
    model.register_forward_hook(lambda mod, args, out: seen.append(("forward", len(out))))
    model(torch.randn(2, 16))[0].sum().backward()
    assert seen == [("forward", 3), ("grad", torch.Size([1, 32]))]


def test_parameter_hooks_run_only_where_a_gradient_arrives():
    """Eager runs a parameter's hooks only where its gradient arrives. A lazy call's node, and a
    first step's probe, hand None on for the parameters outside the mask, which PyTorch passes
    to their hooks, and after it runs their post-accumulate hooks: a hook written for eager (a
    clamp) failed there."""
    torch.manual_seed(0)
    model = lazygrad.lazy(ThreeHeadMLP(), wait_for_builds=True)
    eager = _reference(model)
    x = torch.randn(8, 16)
    calls: dict[torch.nn.Module, list[str]] = {model: [], eager: []}
    for m in (model, eager):
        for name, p in m.named_parameters():
            p.register_hook(
                lambda g, log=calls[m], name=name: log.append(name) or g.clamp(-0.01, 0.01))
            p.register_post_accumulate_grad_hook(
                lambda p, log=calls[m], name=name: log.append(f"{name} {p.grad.shape}"))
    # The first step runs eagerly behind the probe; the others through ORT, two of them with a
    # mask first seen at their backward.
    for outputs in ([0], [1], [0, 2], [0]):
        results = {}
        for m in (model, eager):
            calls[m].clear()
            out = m(x)
            results[m] = out
            sum(out[i].square().mean() for i in outputs).backward()
        for index, (a, b) in enumerate(zip(results[model], results[eager])):
            assert_close(a.detach(), b.detach(), f"output {index}, outputs {outputs}")
        assert sorted(calls[model]) == sorted(calls[eager]), outputs
    assert_grads_equal(model, eager, "clamped by the hooks, accumulated over 4 steps")
    stats = lazygrad.stats(model)
    assert (stats.eager_steps, stats.builds, stats.fallbacks) == (1, 3, 0)


def test_forward_hook_that_changes_the_output_is_applied_once():
    model = LazyMLP()
    eager = _reference(model)
    for m in (model, eager):
        m.register_forward_hook(lambda mod, args, out: tuple(o * 2 for o in out))
    x = torch.randn(2, 16)
    assert_close(model(x)[0].detach(), eager(x)[0].detach(), "hooked output")


def _hooked_pair(hook_for: Callable[[dict], Callable]) -> tuple[torch.nn.Module, ...]:
    """A lazy MLP and its eager twin, each with `hook_for(its store)` on its activation."""
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        store: dict = {}
        net[1].register_forward_hook(hook_for(store))
        made.append((net, store))
    (lazy, lazy_store), (eager, eager_store) = made
    return lazygrad.lazy(lazy), lazy_store, eager, eager_store


def test_a_submodule_hook_that_keeps_activations_sees_each_steps_real_tensors():
    """A feature extractor's hook stores a submodule's output for the loss. Traced, it would
    keep the trace's tensor and ORT steps would never store theirs: the model runs in parts,
    whose calls fire the hook with real tensors, and the loss on the feature trains as eager."""
    def keeper(store):
        return lambda module, args, out: store.__setitem__("feature", out)

    lazy, lazy_store, eager, eager_store = _hooked_pair(keeper)
    with pytest.warns(lazygrad.GraphBreakWarning, match="keeps 1 tensor"):
        for step in range(4):
            x = torch.randn(5, 8)
            outs, features = [], []
            for model, store in ((lazy, lazy_store), (eager, eager_store)):
                outs.append(model(x))
                features.append(store["feature"])  # where the loss reads it, after the forward
                (outs[-1].sum() + features[-1].square().sum()).backward()
            # After the backward too, where the first step's graphs would be traced.
            assert type(features[0]) is torch.Tensor and lazy_store["feature"] is features[0]
            assert_close(outs[0].detach(), outs[1].detach(), f"output, step {step}")
            assert_close(features[0].detach(), features[1].detach(), f"feature, step {step}")
    assert_grads_equal(lazy, eager, "4 steps with the feature loss")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and "under 'feature'" in stats.reasons[0]
    assert {name: part.hits for name, part in stats.parts.items()} == {"0": 2, "2": 2}
    assert all(part.fallbacks == 0 for part in stats.parts.values())


def test_a_submodule_hook_that_counts_in_python_fires_at_every_step():
    """A call counter and a FLOP counter (Python numbers from shapes) on submodules: traced,
    they ran once for a whole training (ORT steps run no Python), with no sign of it. Now the
    model runs in parts and the hooked submodules fire their hooks around their own lazy calls,
    every step through ORT. The first call, run by eager PyTorch, finds them, so no trace calls
    them: the counts are eager's from the first step."""
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        counts = {"calls": 0, "flops": 0}
        net[0].register_forward_hook(
            lambda module, args, out, c=counts: c.__setitem__("calls", c["calls"] + 1))
        net[2].register_forward_pre_hook(lambda module, args, c=counts: c.__setitem__(
            "flops", c["flops"] + args[0].numel() * module.weight.shape[0]))
        made.append((net, counts))
    (lazy, lazy_counts), (eager, eager_counts) = made
    lazy = lazygrad.lazy(lazy, wait_for_builds=True)
    with pytest.warns(lazygrad.GraphBreakWarning, match="return nothing and compute nothing"):
        for step in range(6):
            x = torch.randn(4, 6)
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
            assert_grads_equal(lazy, eager, f"step {step}")
            assert lazy_counts == eager_counts == {"calls": step + 1,
                                                   "flops": (step + 1) * 4 * 8 * 3}
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.parts["0"].hits >= 3 and stats.parts["2"].hits >= 3
    assert stats.fallbacks == 0 and all(part.fallbacks == 0 for part in stats.parts.values())


def test_a_submodule_hook_that_collects_outputs_in_a_list_holds_each_steps_real_ones():
    """Activations collected in a list by a hook, stacked after the steps (an activation
    statistic, a calibration pass): traced, the hook appended the trace's tensors to the user's
    list ("Attempting to use FunctionalTensor on its own" when stacked). The first call, run by
    eager PyTorch, sees the hook keep its tensor, so no trace runs it: the list holds one real
    tensor per step, eager's, and the model's parts run through ORT."""
    lazy, lazy_store, eager, eager_store = _hooked_pair(
        lambda store: lambda module, args, out: store.setdefault("outputs", []).append(
            out.detach()))
    kept = r"keeps 1 tensor\(s\) after the call \(a list"
    with pytest.warns(lazygrad.GraphBreakWarning, match=kept):
        for step in range(4):
            sum_step_like_eager(lazy, eager, (torch.randn(5, 8),), f"step {step}")
    assert len(lazy_store["outputs"]) == 4
    assert all(type(t) is torch.Tensor for t in lazy_store["outputs"])
    assert_close(torch.stack(lazy_store["outputs"]), torch.stack(eager_store["outputs"]),
                 "the collected outputs")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert {name: part.hits for name, part in stats.parts.items()} == {"0": 2, "2": 2}


@pytest.mark.parametrize("eager_ends_first", [True, False])
@pytest.mark.parametrize("eager_starts_first", [True, False])
def test_watches_that_overlap_each_see_the_hook_and_leave_the_users_own(eager_starts_first,
                                                                         eager_ends_first):
    """A signature's first call, watched on the caller's thread, may start or end while the
    background trace of another watches the same hooks: each sees its calls while it runs, and
    the user's own hook is back in its dict once both end, in any order."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    calls = []
    hook = lambda module, args, out: calls.append(1)  # noqa: E731 (a counter: a side effect)
    net[0].register_forward_hook(hook)
    (key,) = net[0]._forward_hooks
    with contextlib.ExitStack() as trace_watch, contextlib.ExitStack() as eager_watch:
        def eager_start():
            return eager_watch.enter_context(forward_hooks.watching_eager_call(net))

        def trace_start():
            return trace_watch.enter_context(forward_hooks.watching(net))

        order = [eager_start, trace_start] if eager_starts_first else [trace_start, eager_start]
        started = {start: start() for start in order}
        seen, found = started[eager_start], started[trace_start]
        net(torch.randn(2, 3))
        assert seen.side_effects == ["0"] and found == ["0"] and len(calls) == 1
        (eager_watch if eager_ends_first else trace_watch).close()
        net(torch.randn(2, 3))
        assert len(calls) == 2
        assert (found, seen.side_effects) == ((["0", "0"], ["0"]) if eager_ends_first
                                              else (["0"], ["0", "0"]))
    assert net[0]._forward_hooks[key] is hook
    net(torch.randn(2, 3))
    assert len(calls) == 3


_ACTIVATIONS: list = []


class CollectsInAGlobal(torch.nn.Module):
    """Appends its hidden activation to a module-level list, as research code does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.tanh(self.a(x))
        _ACTIVATIONS.append(hidden.detach())
        return self.b(hidden)


def test_a_forward_that_appends_to_a_global_list_leaves_only_real_tensors_there():
    """Traced, the forward appended the trace's tensors to the global list before the trace
    found them kept. The first call, run by eager PyTorch, sees the list gain a tensor, so no
    trace runs the forward whole: the list holds each step's real activation, eager's."""
    torch.manual_seed(0)
    eager = CollectsInAGlobal()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    _ACTIVATIONS.clear()
    with pytest.warns(lazygrad.GraphBreakWarning, match=r"\(a list, .*_ACTIVATIONS\)"):
        for step in range(4):
            sum_step_like_eager(lazy, eager, (torch.randn(5, 8),), f"step {step}")
    assert len(_ACTIVATIONS) == 8 and all(type(t) is torch.Tensor for t in _ACTIVATIONS)
    assert_close(torch.stack(_ACTIVATIONS[0::2]), torch.stack(_ACTIVATIONS[1::2]),
                 "lazygrad's activations against eager's")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert {name: part.hits for name, part in stats.parts.items()} == {"a": 2, "b": 2}


class Recorded(torch.nn.Module):
    """Records its blocks' outputs through hooks into a collector that lives for one call and
    returns them, as Hugging Face's output recorders do: the hooks' tensors stay in the call."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, 8))
        self.collector: list | None = None
        for block in self.blocks:
            block.register_forward_hook(self._record)

    def _record(self, module, args, out):
        if self.collector is not None:
            self.collector.append(out * 1.0)

    def forward(self, x):
        self.collector = []
        try:
            return self.blocks(x), tuple(self.collector)
        finally:
            self.collector = None


def test_hooks_whose_tensors_stay_in_the_call_are_traced_with_it():
    torch.manual_seed(0)
    eager = Recorded()
    model = lazygrad.lazy(copy.deepcopy(eager))
    for _ in range(3):
        x = torch.randn(4, 8)
        grads = []
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
            out, recorded = m(x)
            (out.sum() + sum(r.square().sum() for r in recorded)).backward()
            grads.append([p.grad for p in m.parameters()])
        assert_close(out.detach(), model(x)[0].detach(), "output")
        for a, b in zip(*grads):
            assert_close(a, b, "gradient through the recorded outputs")
    stats = lazygrad.stats(model)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0


def test_backward_hooks_on_submodules_are_called_and_applied_as_in_eager():
    """A traced graph drops the autograd nodes a submodule's backward hooks hang on: ORT steps
    neither called them nor applied the gradient they return (3.8 off in a weight gradient,
    with no fallback). The model runs in parts; the hooked submodule's hooks wrap its own lazy
    call, and its first, eager, step calls them too (its output is a custom Function's view)."""
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        seen: list = []
        net[2].register_full_backward_hook(lambda m, grad_in, grad_out, seen=seen:
                                           seen.append(grad_out[0].clone()))
        net[2].register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 0.5,))
        made.append((net, seen))
    (lazy, lazy_seen), (eager, eager_seen) = made
    lazy = lazygrad.lazy(lazy)
    with pytest.warns(lazygrad.GraphBreakWarning, match="backward hooks on submodules \\(2\\)"):
        for step in range(4):
            x = torch.randn(5, 8)
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
            assert len(lazy_seen) == len(eager_seen) == step + 1
            assert_close(lazy_seen[-1], eager_seen[-1], f"gradient the hook saw, step {step}")
            assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and {name: part.hits for name, part in stats.parts.items()} == \
        {"0": 2, "2": 2}


class AuxThroughArgument(torch.nn.Module):
    """Hands an auxiliary (router) loss back by appending it to a list the caller passes."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = torch.nn.Linear(8, 8)
        self.router = torch.nn.Linear(8, 2)

    def forward(self, x, aux_losses: list):
        aux_losses.append(self.router(x).softmax(-1).square().mean())
        return self.expert(x)


def test_a_forward_that_fills_a_list_argument_fills_the_callers_list_every_step():
    """Traced, ORT steps ran no Python: the caller's list stayed empty, and the router trained
    without its loss (0.15 off in its gradient, no fallback)."""
    torch.manual_seed(0)
    eager = AuxThroughArgument()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    with pytest.warns(lazygrad.GraphBreakWarning, match="changes a list or dict it was given"):
        for step in range(4):
            x = torch.randn(4, 8)
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                aux: list = []
                out = model(x, aux)
                assert len(aux) == 1, f"step {step}"
                (out.square().sum() + aux[0]).backward()
            assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and {name: part.hits for name, part in stats.parts.items()} == \
        {"expert": 2, "router": 2}


def test_making_a_module_lazy_twice_is_an_error():
    model = lazygrad.lazy(ThreeHeadMLP())
    with pytest.raises(TypeError, match="lazy already"):
        lazygrad.lazy(model)
    with pytest.raises(TypeError, match="lazy already"):
        lazygrad.lazy(LazyMLP())


def test_bad_options_and_targets_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="policy must be one of"):
        lazygrad.lazy(ThreeHeadMLP(), policy="sometimes")
    with pytest.raises(TypeError, match="expects an nn.Module"):
        lazygrad.lazy(42)
    with pytest.raises(TypeError, match="is not lazy"):
        lazygrad.stats(ThreeHeadMLP())


def test_to_float64_exports_a_float64_graph_with_eager_float64_gradients():
    torch.manual_seed(0)
    model = LazyMLP()
    x = torch.randn(4, 16)
    model(x)[0].sum().backward()
    model.double()
    eager = _reference(model).double()
    model.zero_grad(set_to_none=True)
    out = model(x.double())
    expected = eager(x.double())
    assert out[1].dtype == torch.float64
    assert_close(out[1].detach(), expected[1].detach(), "float64 output")
    out[1].sum().backward()
    expected[1].sum().backward()
    assert_close(model.classify.weight.grad, eager.classify.weight.grad, "float64 grad")
    stats = lazygrad.stats(model)
    assert stats.exports == 2 and len({e.forward for e in stats.entries}) == 2


def test_a_float64_erf_gelu_runs_in_parts_with_the_kernel_ort_lacks_named():
    """ORT's CPU provider has no float64 Erf: the reason says so, not ORT's message alone."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).double()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    with pytest.warns(lazygrad.GraphBreakWarning):
        for step in range(4):  # the whole's build fails at step 0's; the parts', at step 1's
            sum_step_like_eager(lazy, eager, (x,), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert "provider has no Erf kernel for this graph's dtypes" in stats.reasons[0]
    assert stats.parts["0"].hits == 2 and stats.parts["2"].hits == 2


def test_replacing_a_head_or_a_parameter_after_the_first_call_is_seen():
    torch.manual_seed(0)
    model = LazyMLP()
    x = torch.randn(4, 16)
    model(x)[0].sum().backward()
    model.regress = torch.nn.Linear(32, 1)  # a new head (fine-tuning)
    model.classify._parameters["bias"] = torch.nn.Parameter(torch.full((5,), 3.0))  # no hooks
    model.embed.weight.requires_grad_(False)  # frozen
    _assert_same_training_step(model, x)
    outputs = model(x)
    assert_close(outputs[1].detach(), _reference(model)(x)[1].detach(), "output, new bias")
    outputs[2].sum().backward()
    assert model.embed.weight.grad is None and model.embed.bias.grad is not None


class Heads(torch.nn.Module):
    """Two outputs: a projection and an `exp`, whose backward reads the output itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 8)

    def forward(self, x):
        h = self.linear(x)
        return h * 2, h.exp()


def test_outputs_may_be_changed_in_place_from_the_first_call_as_in_eager():
    torch.manual_seed(0)
    eager = Heads()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(4, 6)
    for step in range(3):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        results = []
        for model in (lazy, eager):
            scaled, grown = model(x)
            scaled /= 2.0  # the first call's output too (it failed: a Function's view)
            (scaled.sum() + grown.sum()).backward()
            results.append((scaled.detach(), grown.detach()))
        for got, want in zip(*results):
            assert_close(got, want, f"step {step}: output")
        assert_grads_equal(lazy, eager, f"step {step}")
    assert lazygrad.stats(lazy).fallbacks == 0


def test_changing_an_output_that_eager_saved_raises_eagers_error_at_the_first_call_too():
    lazy = lazygrad.lazy(Heads(), wait_for_builds=True)
    _, grown = lazy(torch.randn(4, 6))  # the first call: eager, behind the probe
    grown += 1  # exp's backward reads this output: eager refuses the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grown.sum().backward()


class Memory:
    """A plain object the caller hands in, read and changed by the forward (as a key/value
    cache is)."""

    def __init__(self) -> None:
        self.state = torch.zeros(4, 8)


class Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.Linear(16, 8)

    def forward(self, x, memory: Memory, scale: float = 1.0):
        memory.state = torch.tanh(self.cell(torch.cat([x, memory.state.detach()], -1))) * scale
        return memory.state


def test_calls_with_an_object_argument_run_eagerly_with_one_warning_and_change_the_object():
    """A trace baked the object's tensors into the graph and left trace tensors in the
    caller's object (Hugging Face's generate crashed at its second token)."""
    torch.manual_seed(0)
    eager = Recurrent()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    memories = Memory(), Memory()
    with pytest.warns(lazygrad.FallbackWarning, match=r"argument 'memory' \(a Memory\)") as seen:
        for step in range(3):
            x = torch.randn(4, 8)
            for model, memory in zip((lazy, eager), memories):
                model.zero_grad(set_to_none=True)
                model(x, memory=memory, scale=0.5).square().sum().backward()
            assert_close(memories[0].state.detach(), memories[1].state.detach(), f"step {step}")
            assert_grads_equal(lazy, eager, f"step {step}")
    assert len([w for w in seen if issubclass(w.category, lazygrad.FallbackWarning)]) == 1
    assert type(memories[0].state) is torch.Tensor
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.eager_steps, stats.builds) == (1, 3, 0)


class Keyworded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None, *, labels=None):
        return self.linear(input_ids)


@lazygrad.lazy
class LazyKeyworded(Keyworded):
    def forward(self, input_ids, attention_mask=None, *, labels=None):
        return super().forward(input_ids, attention_mask, labels=labels)


def test_a_lazy_forward_shows_the_parameters_of_the_forward_it_runs():
    """Callers read them: Hugging Face's Trainer keeps only the batch columns the forward
    names, and an instance's `(*args, **kwargs)` left it none."""
    expected = inspect.signature(Keyworded().forward)
    assert inspect.signature(lazygrad.lazy(Keyworded()).forward) == expected
    assert inspect.signature(LazyKeyworded().forward) == expected
    patched = Keyworded()
    patched.forward = lambda input_ids, extra=0: input_ids
    assert list(inspect.signature(lazygrad.lazy(patched).forward).parameters) == \
        ["input_ids", "extra"]


def test_a_forward_wrapped_after_the_model_was_made_lazy_runs_through_ort():
    """Accelerate's mixed precision wraps `model.forward` in autocast on the instance: the
    runtime then ran that wrapper, which called the runtime again, without end."""
    torch.manual_seed(0)
    eager = ThreeHeadMLP()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    lazy.forward = torch.autocast("cpu", enabled=False)(lazy.forward)
    assert list(inspect.signature(lazy.forward).parameters) == ["x"]
    for step in range(3):
        x = torch.randn(4, 16)
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
            a, b, c = model(x)
            (a.sum() + b.square().mean()).backward()
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2


def _trained_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A lazy model that has run through ORT, and an eager copy of its weights."""
    torch.manual_seed(0)
    lazy = lazygrad.lazy(ThreeHeadMLP())
    for _ in range(2):
        a, b, _ = lazy(torch.randn(4, 16))
        (a.sum() + b.square().mean()).backward()
    assert lazygrad.stats(lazy).hits == 1
    return lazy, _reference(lazy)


def test_torch_func_transforms_see_the_plain_module():
    """grad, vmap and jacrev (per-sample gradients, meta-learning) differentiate the module's
    PyTorch forward: its autograd Function raised under them, through ORT."""
    from torch.func import functional_call, grad, jacrev, vmap

    lazy, eager = _trained_pair()
    x = torch.randn(6, 16)

    def per_sample_grads(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, xi):
            a, b, _ = functional_call(model, p, (xi.unsqueeze(0),))
            return a.sum() + b.square().mean()

        return vmap(grad(loss), in_dims=(None, 0))(params, x)

    got, expected = per_sample_grads(lazy), per_sample_grads(eager)
    for name in expected:
        assert_close(got[name], expected[name], name)
    assert_close(jacrev(lambda v: lazy(v)[0])(x[0]), jacrev(lambda v: eager(v)[0])(x[0]),
                 "jacobian")
    assert lazygrad.stats(lazy).fallbacks == 0


@pytest.mark.parametrize("trained", [False, True])
def test_batched_cotangents_and_vectorised_jacobians_give_eagers_gradients(trained):
    """`is_grads_batched=True` and `jacobian(vectorize=True)` run the backward under vmap: a
    batch of cotangents, which ORT cannot take. Both at a signature's first call (its probe
    built from them, and failed: the signature ran in parts from then on) and through a built
    pair, eager's gradients; a later plain step still runs through ORT."""
    lazy, eager = _trained_pair() if trained else (lazygrad.lazy(ThreeHeadMLP()), None)
    eager = eager or _reference(lazy)
    x = torch.randn(4, 16)
    rows = torch.eye(4).unsqueeze(-1)  # a cotangent per row of the first output, [4, 4, 1]
    for m in (lazy, eager):
        m.zero_grad(set_to_none=True)
    batched = {}
    for m in (lazy, eager):
        xi = x.clone().requires_grad_()
        (batched[m],) = torch.autograd.grad(m(xi)[0], xi, rows, is_grads_batched=True)
    assert_close(batched[lazy], batched[eager], "rows of the input's jacobian")
    jacobians = [torch.autograd.functional.jacobian(lambda v, m=m: m(v)[0], x, vectorize=True)
                 for m in (lazy, eager)]
    assert_close(*jacobians, "vectorised jacobian")
    for m in (lazy, eager):
        (m(x)[0].sum() + m(x)[1].square().mean()).backward()
    assert_grads_equal(lazy, eager, "a plain step after")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


def test_forward_mode_ad_and_anomaly_mode_see_the_plain_module():
    """A dual input's tangent needs a jvp, which ORT's autograd node has none of (the call
    raised); anomaly mode checks each backward node of eager's for NaN, and a NaN made and
    masked inside ORT's one node went unseen (`sqrt`'s infinite slope at 0 times a zero
    cotangent, behind a ReLU)."""
    import torch.autograd.forward_ad as fwad

    lazy, eager = _trained_pair()
    x, tangent = torch.randn(4, 16), torch.randn(4, 16)
    tangents = []
    for m in (lazy, eager):
        with fwad.dual_level():
            tangents.append(fwad.unpack_dual(m(fwad.make_dual(x, tangent))[0]).tangent)
    assert_close(*tangents, "forward-mode tangent")

    class Rooted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.sqrt(torch.relu(self.linear(x)))

    torch.manual_seed(0)
    rooted = lazygrad.lazy(Rooted(), wait_for_builds=True)
    x = torch.randn(4, 8)
    for _ in range(2):  # the second call runs through ORT
        (rooted(x) * 0).sum().backward()
    assert rooted.linear.weight.grad.isfinite().all()  # the NaN is masked
    with torch.autograd.detect_anomaly(check_nan=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's own warning
        with pytest.raises(RuntimeError, match="SqrtBackward0' returned nan"):
            (rooted(x) * 0).sum().backward()
    assert lazygrad.stats(lazy).fallbacks == 0 and lazygrad.stats(rooted).fallbacks == 0


@pytest.mark.parametrize("how", ["torch.export", "torch.onnx.export", "torch.jit.trace"])
def test_exporters_export_the_plain_module(how, tmp_path):
    """A trained lazy model exported for serving: torch's tracers see its PyTorch forward (the
    exporters failed on lazygrad's instance forward, or traced its ORT call)."""
    import onnxruntime

    lazy, eager = _trained_pair()
    lazy.eval(), eager.eval()
    x = torch.randn(3, 16)
    expected = eager(x)
    if how == "torch.export":
        got = torch.export.export(lazy, (x,)).module()(x)
    elif how == "torch.jit.trace":
        got = torch.jit.trace(lazy, (x,))(x)
    else:
        path = str(tmp_path / "model.onnx")
        torch.onnx.export(lazy, (x,), path, dynamo=True)
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        got = [torch.from_numpy(o) for o in
               session.run(None, {session.get_inputs()[0].name: x.numpy()})]
    for index, (g, e) in enumerate(zip(got, expected)):
        assert_close(g.detach(), e.detach(), f"output {index}")
    a, b, _ = lazy.train()(torch.randn(4, 16))  # and it still runs through ORT
    (a.sum() + b.square().mean()).backward()
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0


class WithLazyPart(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = lazygrad.lazy(ThreeHeadMLP())
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.body(x)[1])


def test_fx_symbolic_tracing_traces_a_lazy_submodule_as_plain_code():
    """FX (torchvision's feature extractors) calls a lazy submodule with proxies: it is traced
    as its PyTorch forward, not counted as a fallback on a proxy argument."""
    torch.manual_seed(0)
    model = WithLazyPart()
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        traced = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 16)
    assert_close(traced(x).detach(), model(x).detach(), "output")
    assert lazygrad.stats(model.body).fallbacks == 0


def _mlp_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True), eager


def test_global_forward_hooks_fire_for_every_submodule_at_every_step():
    """A call counter and an activation logger registered for every module
    (`register_module_forward_hook`, `..._pre_hook`): ORT steps called them for the model's own
    call alone, none of its submodules', with no sign of it. While they are registered the model
    runs in parts down to its leaves, whose calls fire them, every step through ORT, counts
    exact from the first step (no trace calls them). Removed, the model runs whole again."""
    lazy, eager = _mlp_pair()
    seen: dict[str, list] = {"lazy": [], "eager": []}
    current = {"log": seen["lazy"]}

    def count(module, args):
        current["log"].append(type(module).__name__)

    def keep(module, args, out):
        if isinstance(module, torch.nn.Linear):
            current["log"].append(out.detach().clone())

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(count),
               torch.nn.modules.module.register_module_forward_hook(keep)]
    try:
        with pytest.warns(lazygrad.GraphBreakWarning, match="global module forward hooks"):
            for step in range(4):
                x = torch.randn(5, 6)
                for name, model in (("lazy", lazy), ("eager", eager)):
                    seen[name].clear()
                    current["log"] = seen[name]
                    model.zero_grad(set_to_none=True)
                    model(x).square().sum().backward()
                names = [item for item in seen["lazy"] if isinstance(item, str)]
                assert names == [item for item in seen["eager"] if isinstance(item, str)] == \
                    ["Sequential", "Linear", "Tanh", "Linear"], f"step {step}"
                kept = [(a, b) for a, b in zip(seen["lazy"], seen["eager"])
                        if isinstance(b, torch.Tensor)]
                assert len(kept) == 2
                for a, b in kept:
                    assert type(a) is torch.Tensor
                    assert_close(a, b, f"logged activation, step {step}")
                assert_grads_equal(lazy, eager, f"step {step}")
    finally:
        for handle in handles:
            handle.remove()
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert stats.parts["0"].hits >= 2 and stats.parts["2"].hits >= 2
    lazygrad.reset_stats(lazy)
    for step in range(3):
        sum_step_like_eager(lazy, eager, (torch.randn(5, 6),), f"unhooked step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.hits >= 2 and stats.breaks == 0 and stats.fallbacks == 0


def test_a_global_hook_registered_after_a_build_is_not_skipped_by_the_old_graphs():
    """Global hooks are part of the signature: a logger registered once the model trains
    through ORT sees the next step's submodule calls, and a global backward hook that rescales
    a gradient is applied, as in eager (the old graphs ran neither)."""
    lazy, eager = _mlp_pair()
    for step in range(3):
        sum_step_like_eager(lazy, eager, (torch.randn(5, 6),), f"step {step}")
    assert lazygrad.stats(lazy).hits == 2
    logged: list = []

    def log(module, args, out):
        logged.append(type(module).__name__)

    def halve(module, grad_output):
        return tuple(None if g is None else g * 0.5 for g in grad_output)

    handles = [torch.nn.modules.module.register_module_forward_hook(log),
               torch.nn.modules.module.register_module_full_backward_pre_hook(halve)]
    try:
        with pytest.warns(lazygrad.GraphBreakWarning, match="global module"):
            for step in range(3):
                logged.clear()
                sum_step_like_eager(lazy, eager, (torch.randn(5, 6),), f"hooked step {step}")
                assert logged[:4] == logged[4:] and len(logged) == 8, f"step {step}"
    finally:
        for handle in handles:
            handle.remove()
    assert lazygrad.stats(lazy).fallbacks == 0


class TracksItsRange(torch.nn.Module):
    """Keeps a running minimum as a buffer it assigns anew at every call (I-BERT's `QuantAct`),
    or, `grows`, one it replaces with a longer tensor."""

    def __init__(self, grows: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("low", torch.zeros(1))
        self.grows = grows

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        if self.grows:
            self.low = torch.cat([self.low, y.detach().min().reshape(1)])
        else:
            self.low = self.low * 0.9 + y.detach().min() * 0.1
        return y


@pytest.mark.parametrize("grows", [False, True])
def test_a_buffer_the_forward_assigns_anew_is_updated_as_eager_updates_it(grows):
    """The trace swaps its own tensors into the module and restores them after: a buffer the
    forward replaced was restored too, the graph never updated it, and ORT steps left it at
    its first value, silently (I-BERT's ranges). Its new value is written into the buffer now;
    one of another shape is refused with its reason, and eager's runs."""
    torch.manual_seed(0)
    eager = TracksItsRange(grows)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            sum_step_like_eager(lazy, eager, (torch.randn(3, 4) * (step + 1),), f"step {step}")
            assert_close(lazy.low, eager.low, f"step {step}: the buffer")
    stats = lazygrad.stats(lazy)
    if grows:
        assert any("replaces its buffer 'low'" in str(w.message) for w in caught)
        assert stats.hits == 0
    else:
        assert not caught and stats.hits == 4 and (stats.fallbacks, stats.breaks) == (0, 0)
