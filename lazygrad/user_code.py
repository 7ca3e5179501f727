"""The user's code run eagerly and the user's code traced, never at the same time.

A trace runs the module's forward with `torch.compiler.is_compiling()` true on its thread, so
that models take the paths they take under torch.compile (capture/private.py, `compiling`).
Code on those paths may assume what torch.compile guarantees: nothing else runs it meanwhile.
Transformers 5's output collector does (`CompileableContextVar`: while one thread compiles,
every thread reads the collector from a global): an eager step of Hugging Face Mixtral with
`output_router_logits`, run on the training thread while its graphs were traced in the
background, appended its router logits to the trace's collector and failed on none
(IndexError in `load_balancing_loss_func`, in 3 of 3 runs by the tenth step), and the trace,
finding other outputs than the first time, failed too.

So a trace waits for the eager runs going on (`eager_run`, around every forward lazygrad runs
in PyTorch), and an eager run waits for a trace going on (`traced`): a step beside a build
waits for the trace alone, never for the export or the check. A thread that waits for a build
(`lent`: `builder.run`) is not waited for, so a build asked for from inside an eager run (a
backward within a forward) cannot wait on itself.

The user's other models share those globals too: a model lazygrad does not run (an eager
reference, a distillation teacher, an EMA copy) of the same library, called on the training
thread while a trace ran in the background. Hugging Face Llama's attention is wrapped by the
`kernels` library, whose own compile-aware ContextVar flips to a global for every thread while
one compiles: a plain Llama stepped beside a lazy one crashed in 2 of 3 runs ("expected an
instance of Token"), and a plain Mixtral's recorded outputs would land in the trace's
collector. So while a trace runs, every module call of other threads (but those waiting for a
build) waits at its start and at its end, before its own hooks (`_held_while_tracing`, a
global forward pre-hook and hook that lazygrad registers for the trace's time only).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch.nn.modules import module as torch_module

from lazygrad import global_hooks

_changed = threading.Condition()
_running: dict[int, int] = {}  # thread -> its eager runs going on (nested calls counted)
_lending: set[int] = set()  # threads waiting for a build
_tracer: int | None = None  # the thread tracing


@contextlib.contextmanager
def eager_run() -> Iterator[None]:
    """Around the user's forward run in PyTorch: waits while another thread traces."""
    me = threading.get_ident()
    with _changed:
        _changed.wait_for(lambda: _tracer is None or _tracer == me)
        _running[me] = _running.get(me, 0) + 1
    try:
        yield
    finally:
        with _changed:
            _running[me] -= 1
            if not _running[me]:
                del _running[me]
            _changed.notify_all()


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Around a trace of the user's forward: waits for other threads' eager runs (but those of
    threads waiting for a build) and keeps new ones waiting until it ends."""
    global _tracer
    me = threading.get_ident()
    with _changed:
        _changed.wait_for(lambda: _tracer is None and all(
            thread == me or thread in _lending for thread in _running))
        _tracer = me
    entering = torch_module.register_module_forward_pre_hook(_held_while_tracing)
    leaving = torch_module.register_module_forward_hook(_held_while_tracing)
    try:
        yield
    finally:
        entering.remove()
        leaving.remove()
        with _changed:
            _tracer = None
            _changed.notify_all()


@global_hooks.own
def _held_while_tracing(*_: Any) -> None:
    """Around every module call while a trace runs: another thread's call waits for the trace
    to end (the tracing thread and threads waiting for a build go on)."""
    me = threading.get_ident()
    if _tracer in (None, me) or me in _lending:
        return
    with _changed:
        _changed.wait_for(lambda: _tracer is None or me in _lending)


@contextlib.contextmanager
def lent() -> Iterator[None]:
    """Around a thread's wait for a build: its eager runs, paused, do not hold the trace."""
    me = threading.get_ident()
    with _changed:
        _lending.add(me)
        _changed.notify_all()
    try:
        yield
    finally:
        with _changed:
            _lending.discard(me)
