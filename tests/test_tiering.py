"""Tiered execution: a step that needs graphs not built yet runs in eager PyTorch while they
build on the builder thread, and the first call after they are ready runs through ORT. Builds
are held at a gate here, so which steps run while building is decided by the test, not by
timing; every step is compared with eager PyTorch."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from conftest import assert_close, assert_grads_equal, ran_through_ort
from test_graph_breaks import Noisy

import lazygrad
import lazygrad.runtime as runtime
from lazygrad import builder
from lazygrad.capture import CaptureError
from lazygrad.examples.models import ThreeHeadMLP


class Gate:
    """Holds every capture until opened (or refuses it, with `refuse`)."""

    def __init__(self, monkeypatch, refuse: bool = False) -> None:
        self.open_event = threading.Event()
        self.started = threading.Event()
        self.refuse = refuse
        real = runtime.capture

        def gated(*args, **kwargs):
            self.started.set()
            assert self.open_event.wait(60), "the test never opened the gate"
            if self.refuse:
                raise CaptureError("refused by the test")
            return real(*args, **kwargs)

        monkeypatch.setattr(runtime, "capture", gated)

    def open(self) -> None:
        self.open_event.set()


def _step(lazy, eager, x, loss, what, seed=None):
    for m in (lazy, eager):
        m.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    out = lazy(x)
    if seed is not None:
        torch.manual_seed(seed)
    expected = eager(x)
    for index, (got, want) in enumerate(zip(out, expected)):
        assert_close(got.detach(), want.detach(), f"{what}: output {index}")
    loss(out).backward()
    loss(expected).backward()
    assert_grads_equal(lazy, eager, what)
    return out


def _pair(model=None):
    torch.manual_seed(0)
    eager = model if model is not None else ThreeHeadMLP()
    return lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=False), eager


def test_steps_run_eagerly_while_the_graphs_build_then_through_ort(monkeypatch):
    gate = Gate(monkeypatch)
    lazy, eager = _pair()
    x = torch.randn(6, 16)
    loss = lambda o: o[0].sum() + o[1].square().mean()  # noqa: E731
    for step in range(3):  # the build is held: every step runs in eager PyTorch, none waits
        out = _step(lazy, eager, x, loss, f"building, step {step}")
        assert not ran_through_ort(out)
    assert gate.started.wait(30)  # the builder thread picks the build up in its own time
    stats = lazygrad.stats(lazy)
    assert stats.eager_steps == 3 and stats.builds == 0 and stats.misses == 1  # queued once
    gate.open()
    lazygrad.wait_for_builds(lazy)
    for step in range(2):
        out = _step(lazy, eager, x, loss, f"built, step {step}")
        assert ran_through_ort(out)
    stats = lazygrad.stats(lazy)
    assert stats.builds == 1 and stats.eager_steps == 3 and stats.fallbacks == 0


def test_a_step_that_waits_for_its_build_counts_the_wait_as_the_builds_not_as_step_time(
        monkeypatch):
    real = runtime.capture

    def slow(*args, **kwargs):  # a build of seconds, as a real model's
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "capture", slow)
    model = ThreeHeadMLP()
    eager = copy.deepcopy(model)
    lazy = lazygrad.lazy(model, wait_for_builds=True)
    x = torch.randn(6, 16)
    loss = lambda o: o[0].sum() + o[1].square().mean()  # noqa: E731
    for step in range(2):  # the first backward blocks on the build; the second step is ORT's
        out = _step(lazy, eager, x, loss, f"step {step}")
    assert ran_through_ort(out)
    stats = lazygrad.stats(lazy)
    assert stats.builds == 1 and stats.fallbacks == 0
    # Two steps of this model take milliseconds; the build's two seconds are the build's.
    assert stats.entries[0].build_seconds >= 2.0
    assert 0 < stats.step_seconds < 1.0
    assert 0 < stats.ort_seconds < stats.step_seconds


def test_a_background_build_keeps_no_copy_of_the_parameters():
    """The build traces and checks a copy of the parameters (the optimizer may update them
    meanwhile); once it is done nothing holds that copy: not the check's session bindings on
    the builder thread, which keep the module state they last ran on."""
    earlier = set(map(id, _real_tensors()))  # others' (torch.export leaves some about)
    torch.manual_seed(0)
    lazy = lazygrad.lazy(ThreeHeadMLP(), wait_for_builds=False)
    x = torch.randn(6, 16)
    for _ in range(2):
        out = lazy(x)
        (out[0].sum() + out[1].mean()).backward()
        lazy.zero_grad(set_to_none=True)
        lazygrad.wait_for_builds(lazy)
    stats = lazygrad.stats(lazy)
    assert ran_through_ort(out) and stats.builds == 1 and stats.fallbacks == 0
    del out
    gc.collect()
    own = {p.untyped_storage().data_ptr() for p in lazy.parameters()}
    shapes = {tuple(p.shape) for p in lazy.parameters() if p.numel() > 1}  # not placeholders
    copies = [t for t in _real_tensors() if id(t) not in earlier and tuple(t.shape) in shapes
              and t.untyped_storage().data_ptr() not in own]
    assert copies == []


def _real_tensors() -> list[torch.Tensor]:
    return [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)]


class SlowUpstream(torch.autograd.Function):
    """Upstream of a model: its backward runs last in a step's backward, slowly, and notes when
    it ended in `times`."""

    times: dict[str, float] = {}

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.3)
        SlowUpstream.times["backward ended"] = time.perf_counter()
        return grad


def _time_captures(monkeypatch) -> dict[str, float]:
    """SlowUpstream's times, to which each capture adds when it started."""
    times = SlowUpstream.times
    times.clear()
    real = runtime.capture

    def timed_capture(*args, **kwargs):
        times["capture"] = time.perf_counter()
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "capture", timed_capture)
    return times


def _slow_step(lazy, eager, what):
    x = torch.randn(6, 16, requires_grad=True)
    out = lazy(SlowUpstream.apply(x))
    want = eager(x)
    for index, (got, expected) in enumerate(zip(out, want)):
        assert_close(got.detach(), expected.detach(), f"{what}: output {index}")
    for module, outputs in ((lazy, out), (eager, want)):
        module.zero_grad(set_to_none=True)
        outputs[0].sum().backward()
    assert_grads_equal(lazy, eager, what)
    return out


def test_a_build_met_in_a_backward_starts_when_that_backward_ends(monkeypatch):
    """The rest of the backward (a slow node upstream of the model) runs without the build
    beside it, and the build starts right after."""
    times = _time_captures(monkeypatch)
    lazy, eager = _pair()
    _slow_step(lazy, eager, "first step")
    lazygrad.wait_for_builds(lazy)
    assert times["capture"] >= times["backward ended"]
    stats = lazygrad.stats(lazy)
    assert stats.builds == 1 and stats.fallbacks == 0


def test_a_build_run_now_in_a_backward_does_not_wait_behind_one_waiting_for_that_backward():
    """A module waiting for its builds meets a new mask in the same backward as one that builds
    in the background: the first build waits for that backward's end, which waits for the
    second; the second starts the first instead of waiting out its patience."""
    order = []

    class Inside(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            builder.submit(lambda: order.append("waiting for this backward"))
            started = time.perf_counter()
            builder.run(lambda: order.append("now"))
            order.append(time.perf_counter() - started)
            return grad

    Inside.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert order[:2] == ["waiting for this backward", "now"]
    assert order[2] < 5.0


def test_graphs_from_the_disk_index_serve_the_first_step_without_a_trace(monkeypatch, tmp_path):
    """A second model on the disk cache the first filled runs through ORT from its first step,
    and nothing is traced for it: the index key holds the code (`index_key.py`)."""
    monkeypatch.setenv("LAZYGRAD_CACHE_DIR", str(tmp_path))
    first, eager = _pair()
    _slow_step(first, eager, "first model")
    lazygrad.wait_for_builds(first)
    times = _time_captures(monkeypatch)
    second = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        out = _slow_step(second, eager, "second model, first step")
        lazygrad.wait_for_builds(second)
    assert ran_through_ort(out)
    assert "capture" not in times
    stats = lazygrad.stats(second)
    assert stats.disk_hits == 1 and stats.eager_steps == 0 and stats.fallbacks == 0


def test_a_new_mask_at_backward_is_served_eagerly_with_the_steps_draws_while_it_builds(
        monkeypatch):
    """The forward ran in ORT for the mask last seen; the backward meets another mask: its
    gradients come from eager PyTorch (the forward redone from the saved inputs, Dropout's draws
    replayed) while its graphs build; once built, that mask runs through ORT."""
    lazy, eager = _pair(Noisy())
    x = torch.randn(4, 6)
    first, second = (lambda o: o[0].sum()), (lambda o: o[0].sum() + o[1].square().sum())
    _step(lazy, eager, x, first, "first step", seed=1)
    lazygrad.wait_for_builds(lazy)
    gate = Gate(monkeypatch)
    for step in range(2):
        out = _step(lazy, eager, x, second, f"new mask while building, step {step}", seed=2 + step)
        assert ran_through_ort(out)  # the forward: the previous mask's graphs
    stats = lazygrad.stats(lazy)
    assert stats.builds == 1 and stats.misses == 2 and stats.eager_steps == 3
    gate.open()
    lazygrad.wait_for_builds(lazy)
    _step(lazy, eager, x, second, "new mask built", seed=5)
    _step(lazy, eager, x, second, "new mask planned", seed=6)
    stats = lazygrad.stats(lazy)
    assert stats.builds == 2 and stats.eager_steps == 3 and stats.fallbacks == 0


class LinearHeads(torch.nn.Module):
    """Two Linear heads of a 3-D input: each output is a view of its product (eager's Linear
    multiplies the flattened rows and views the result back)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 4),
                                          torch.nn.Linear(16, 2))

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h), self.aux(h)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("backward", ["a new mask while it builds", "create_graph"])
def test_an_eager_backward_after_an_ort_forward_takes_the_cotangents_of_views(
        monkeypatch, backward):
    """A backward served in eager PyTorch after the forward ran in ORT (a mask first seen at
    backward, or a gradient penalty) got the cotangents of the graph's results, of which the
    outputs are views ([6, 4] for a [2, 3, 4] output), but took the roots as an inference call
    does, where an output that alone views its root is its own: autograd refused the shapes
    (a helper's sweep). They are a training call's roots now."""
    lazy, eager = _pair(LinearHeads())
    x = torch.randn(2, 3, 8)
    _step(lazy, eager, x, lambda o: o[0].sum(), "first step")
    lazygrad.wait_for_builds(lazy)
    if backward == "create_graph":
        results = []
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
            out, _ = model(x)
            first = torch.autograd.grad(out.square().mean(), list(model.head.parameters()),
                                        create_graph=True)
            sum(g.square().sum() for g in first).backward()
            results.append((out, first))
        assert ran_through_ort(results[0][0])
        for index, (got, want) in enumerate(zip(results[0][1], results[1][1])):
            assert_close(got.detach(), want.detach(), f"gradient {index}")
        assert_grads_equal(lazy, eager, "second-order gradients")
    else:
        gate = Gate(monkeypatch)
        out = _step(lazy, eager, x, lambda o: o[0].sum() + o[1].square().sum(),
                    "new mask while building")
        assert ran_through_ort(out)
        gate.open()
    stats = lazygrad.stats(lazy)
    assert stats.eager_steps == 2 and stats.fallbacks == 0


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, x):
        h = x @ self.weight
        return h.tanh(), h.sum()


@pytest.mark.falls_back
def test_a_failed_background_build_leaves_the_signature_eager_with_the_reason(monkeypatch):
    gate = Gate(monkeypatch, refuse=True)
    lazy, eager = _pair(Pair())  # no submodules: it falls back whole
    x = torch.randn(4, 5)
    loss = lambda o: o[0].square().sum()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            _step(lazy, eager, x, loss, f"step {step}")
        gate.open()
        lazygrad.wait_for_builds(lazy)
        for step in range(2):
            _step(lazy, eager, x, loss, f"after failure, step {step}")
    reasons = [str(w.message) for w in caught if issubclass(w.category, lazygrad.FallbackWarning)]
    assert len(reasons) == 1 and "refused by the test" in reasons[0], reasons
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 1 and stats.builds == 0 and stats.eager_steps == 2


def test_an_unexpected_error_in_a_waited_for_build_is_a_fallback_not_a_crash(monkeypatch):
    """torch failing to run a captured graph in the check (a bug of lazygrad's) raised from
    the user's backward when the step waited for the build; it is a fallback with the reason,
    as in a background build."""

    def failing(*args, **kwargs):
        raise RuntimeError("batch2 must be a 3D tensor")

    monkeypatch.setattr(runtime, "verify", failing)
    torch.manual_seed(0)
    eager = Pair()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(4, 5)
    loss = lambda o: o[0].square().sum()  # noqa: E731
    with pytest.warns(lazygrad.FallbackWarning, match="the build failed: RuntimeError: batch2"):
        for step in range(3):
            _step(lazy, eager, x, loss, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 1 and stats.builds == 0


def test_threads_calling_during_a_build_get_eager_results_and_one_build(monkeypatch):
    gate = Gate(monkeypatch)
    lazy, eager = _pair()
    inputs = [torch.randn(5, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    errors: list[BaseException] = []

    def worker(x: torch.Tensor) -> None:
        try:
            for _ in range(3):
                out = lazy(x)
                with torch.no_grad():
                    for got, want in zip(out, eager(x)):
                        assert_close(got, want, "output while building")
                out[0].sum().backward()
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(x,)) for x in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    gate.open()
    lazygrad.wait_for_builds(lazy)
    x = torch.randn(5, 16)
    out = _step(lazy, eager, x, lambda o: o[0].sum(), "after the build")
    assert ran_through_ort(out)
    assert lazygrad.stats(lazy).builds == 1


def test_clear_cache_while_a_build_runs_drops_what_it_brings(monkeypatch):
    gate = Gate(monkeypatch)
    lazy, eager = _pair()
    x = torch.randn(6, 16)
    loss = lambda o: o[1].sum()  # noqa: E731
    _step(lazy, eager, x, loss, "first step")
    assert gate.started.wait(60)
    lazygrad.clear_cache(lazy)
    gate.open()
    lazygrad.wait_for_builds(lazy)
    assert lazygrad.stats(lazy).entries == []  # the build ended after the clear: dropped
    out = _step(lazy, eager, x, loss, "after clear: a first step again")
    assert not ran_through_ort(out)
    lazygrad.wait_for_builds(lazy)
    out = _step(lazy, eager, x, loss, "rebuilt")
    assert ran_through_ort(out)


def test_a_process_that_ends_while_a_build_runs_exits_cleanly(tmp_path):
    """The running build ends (a real one, in ORT and torch's native code), queued ones are
    dropped, and the process exits with status 0, never aborted. Several queued: the builder
    thread, taking the next, freed the last one's tensors after finalization began, and the
    process aborted in torch's deallocation (a quarter of the runs)."""
    script = textwrap.dedent("""
        import torch, lazygrad
        from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch
        models = [lazygrad.lazy(BertPretraining(BertConfig()), wait_for_builds=False)
                  for _ in range(5)]
        for model in models:
            model(*bert_batch(BertConfig()))[0].backward()  # queues its build; returns at once
        print("stepped", flush=True)
    """)
    env = dict(os.environ, LAZYGRAD_CACHE_DIR=str(tmp_path), LAZYGRAD_WAIT_FOR_BUILDS="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=90, env=env)
    assert done.returncode == 0, done.stderr
    assert "stepped" in done.stdout and "Traceback" not in done.stderr
    assert "terminate called" not in done.stderr


class DrawsBesideItsTrace(torch.nn.Module):
    """While its forward is traced, another thread draws from torch's generator, as the
    training thread does while a build runs (its eager steps' Dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if torch.compiler.is_compiling():
            thread = threading.Thread(target=lambda: torch.rand(3))
            thread.start()
            thread.join()
        return self.linear(x)


def test_a_build_never_takes_back_the_draws_made_beside_it():
    """AOTAutograd sets torch's generators back, after a trace, to where it found them: on the
    builder thread that took back the draws the training thread made meanwhile, and from the
    build's end on a Dropout model's numbers were no longer eager's (every step after it,
    under the same seed). Now the trace leaves the generators alone, and the builder thread
    draws from copies of them (`generators.py`)."""
    lazy = lazygrad.lazy(DrawsBesideItsTrace(), wait_for_builds=True)
    x = torch.randn(2, 4)
    torch.manual_seed(5)
    lazy(x).sum().backward()  # eager; its build runs here: 3 numbers drawn beside each run
    got = torch.rand(1)  # of the forward in the trace
    assert lazygrad.stats(lazy).builds == 1
    torch.manual_seed(5)
    drawn = (torch.rand(60) == got).nonzero().flatten().tolist()
    assert len(drawn) == 1 and drawn[0] > 0 and drawn[0] % 3 == 0, drawn  # 0: taken back


class _Compiling:
    """Whether a thread compiles, kept in a global, as transformers 5's output collector
    (`CompileableContextVar`) keeps its collector while one does: every thread reads it."""

    active = False


class Routed(torch.nn.Module):
    """Its forward holds the global while it compiles; an eager run that finds it set reads
    what is not its own (transformers: its router logits went to the trace's collector, and
    `load_balancing_loss_func` failed on none)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 8)
        self.router = torch.nn.Linear(8, 4)

    def forward(self, x):
        compiling = torch.compiler.is_compiling()
        if compiling:
            _Compiling.active = True
        try:
            h = self.hidden(x)
            if compiling:
                time.sleep(0.2)  # a trace of a larger model takes seconds
            elif _Compiling.active:
                raise RuntimeError("an eager run read the global of a trace going on")
            return h, self.router(torch.tanh(h)).square().mean()
        finally:
            if compiling:
                _Compiling.active = False


def test_eager_steps_never_run_beside_a_trace_of_the_same_code():
    """Code that runs as compiling may assume nothing else runs meanwhile (transformers'
    collector does): eager steps beside a background build wait while it traces. Before, an
    eager step read the trace's collector (HF Mixtral with router logits failed within ten
    steps, IndexError) and the trace failed on the outputs it found (the model ran in parts)."""
    lazy, eager = _pair(Routed())
    x = torch.randn(6, 8)
    loss = lambda o: o[0].sum() + o[1]  # noqa: E731
    started = time.monotonic()
    while not lazygrad.stats(lazy).hits:  # eager steps all along the build, then ORT's
        assert time.monotonic() - started < 120, "the build never ended"
        _step(lazy, eager, x, loss, f"{lazygrad.stats(lazy).eager_steps} eager steps")
        time.sleep(0.005)
    assert ran_through_ort(_step(lazy, eager, x, loss, "built"))
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.builds == 1


class _TraceLog:
    """What a trace of `SignalsItsTrace` and the test did, in order (a module-level object: a
    background trace runs a copy of the module's structure). Callable, so no setting of the
    forward's (`code_globals.is_settings`): the trace changes it, and a build whose trace
    changed a value the forward reads is dropped (`runtime.ReadChanged`)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.started = threading.Event()  # a trace started
        self.go_on = threading.Event()  # the trace may end

    def __call__(self, event: str) -> None:
        self.events.append(event)


_trace_log = _TraceLog()


class SignalsItsTrace(torch.nn.Module):
    """Its trace notes when it starts and, once let go on, when it ends; its eager runs note
    nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        if torch.compiler.is_compiling():
            _trace_log("trace starts")
            _trace_log.started.set()
            _trace_log.go_on.wait(60)
            time.sleep(0.2)  # time for a call on another thread to start, were it let
            _trace_log("trace ends")
        return self.linear(x).tanh()


def test_other_models_module_calls_wait_while_a_trace_runs():
    """A model lazygrad does not run (an eager reference, a distillation teacher) shares its
    library's globals with a trace: Hugging Face Llama's attention is wrapped by the `kernels`
    library, whose ContextVar becomes a global for every thread while one compiles, and a
    plain Llama stepped beside a lazy one crashed in 2 of 3 runs ("expected an instance of
    Token"). While a trace runs in the background, another thread's module call waits for it
    (before its own hooks), then runs as it would."""
    _trace_log.events.clear()
    _trace_log.started.clear()
    _trace_log.go_on.clear()
    lazy = lazygrad.lazy(SignalsItsTrace(), wait_for_builds=False)
    plain = torch.nn.Linear(8, 8)
    plain.register_forward_pre_hook(lambda module, args: _trace_log("plain"))
    x = torch.randn(2, 8)
    lazy(x).sum().backward()  # the first call runs eagerly, its backward queues the build
    assert _trace_log.started.wait(60), "no trace started"
    _trace_log.go_on.set()
    torch.testing.assert_close(plain(x), torch.nn.functional.linear(x, plain.weight, plain.bias))
    events = _trace_log.events
    assert events[0] == "trace starts" and events[-2:] == ["trace ends", "plain"], events
    while not lazygrad.stats(lazy).builds:  # the build goes on, and serves the next calls
        time.sleep(0.01)
        lazy(x).sum().backward()
    assert lazygrad.stats(lazy).fallbacks == 0


def _builder_alive() -> bool:
    return any(thread.name == "lazygrad-builder" for thread in threading.enumerate())


def test_the_builder_thread_ends_when_idle_and_a_later_build_starts_another():
    """Alive, the builder thread's OpenMP threads slowed every small op of eager PyTorch on
    the training thread (builder._work): it ends once it has no build."""
    torch.manual_seed(0)
    eager = ThreeHeadMLP()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for width in (4, 6):  # the second signature's build runs on a new builder thread
        x = torch.randn(width, 16)
        deadline = time.monotonic() + 10
        while _builder_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _builder_alive()
        outputs = [model(x) for model in (eager, lazy)]
        for out in outputs:
            out[0].sum().backward()
        assert_close(outputs[1][0], outputs[0][0], f"width {width}: output")
        assert_grads_equal(lazy, eager, f"width {width}")
    assert lazygrad.stats(lazy).builds >= 2 and lazygrad.stats(lazy).fallbacks == 0


def test_the_users_prints_and_warnings_beside_a_background_export_all_arrive(monkeypatch,
                                                                             capsys):
    """The export hid its own warnings by swapping the process's filters, and its prints by
    swapping `sys.stdout`: the training loop's prints and warnings on the other thread were
    lost while it ran. The export is held here while the loop prints and warns, and warns
    itself: the loop's arrive, the export's are not shown."""
    from lazygrad.capture import private, to_onnx

    inside, go_on = threading.Event(), threading.Event()
    export = private.onnx_core._exported_program_to_onnx_program

    def held(*args, **kwargs):
        inside.set()
        warnings.warn("the exporter's own warning", stacklevel=2)
        assert go_on.wait(60), "the test never let the export go on"
        return export(*args, **kwargs)

    monkeypatch.setattr(to_onnx.private.onnx_core, "_exported_program_to_onnx_program", held)
    lazy, eager = _pair()
    x = torch.randn(6, 16)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        _step(lazy, eager, x, lambda o: o[0].sum(), "step 0")
        assert inside.wait(60), "no export started"
        for line in range(20):
            print(f"the loop's line {line}")
            warnings.warn(f"the loop's warning {line}", stacklevel=2)
        go_on.set()
        lazygrad.wait_for_builds(lazy)
    messages = [str(w.message) for w in shown]
    assert messages == [f"the loop's warning {line}" for line in range(20)], messages
    printed = capsys.readouterr().out
    assert all(f"the loop's line {line}\n" in printed for line in range(20)), printed
    stats = lazygrad.stats(lazy)
    assert stats.builds == 1 and stats.fallbacks == 0
