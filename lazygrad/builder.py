"""Builds run on one process-wide builder thread, never inside the caller's autograd call.

A mask first seen at backward is built from inside that backward; tracing there is a backward
inside a backward, and with another thread's backward running at the same time AOTAutograd's
process-global node-metadata bookkeeping broke ("Expected current_level > 0"). On a thread of
its own the trace never nests in an autograd call, and traces never overlap.

A build asked for inside a backward (a mask first seen there) starts when that backward ends:
beside a build, the rest of that backward ran 3-5 times slower on 2 cores (the trace is Python
holding the GIL that the engine's hooks need, and takes a core from torch's threads), which made
the first step of a signature 2-3x an eager one (benchmarks/fresh.py). A backward that raises
runs no end callback, so a build waits for it at most `_BACKWARD_PATIENCE` seconds; so does a
build told to start at some other event (`submit`'s `start`). A build asked to run now (`run`,
whose caller waits for it) starts the builds queued before it that still wait: that caller may be
the very step they wait for.

At exit, builds still queued are dropped (by the exiting thread) and the one running is waited
for: a daemon thread torn down inside ORT or torch's native code aborted the process
("terminate called without an active exception"), and a `ThreadPoolExecutor` would run every
queued build first.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from lazygrad import clock, heap, turns, user_code
from lazygrad.capture import private

T = TypeVar("T")

_Job = tuple[Callable[[], Any], concurrent.futures.Future, threading.Event]
_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_BACKWARD_PATIENCE = 30.0
_IDLE_SECONDS = 0.05  # without a job this long, the builder thread ends (`_work`)
_started = threading.Lock()  # guards `_thread` and `_waiting`
_thread: threading.Thread | None = None
_waiting: set[threading.Event] = set()  # starts of queued builds, not yet given
_idle = threading.Lock()  # held while a build runs
_closing = threading.Event()
_NOW = threading.Event()  # the start of a build that need not wait
_NOW.set()


def _work() -> None:
    """Run the queued builds; end once none has come for `_IDLE_SECONDS` (a later build
    starts another thread). A thread that ran torch's parallel ops (a build's check) keeps its
    own OpenMP threads while it lives, and libgomp, seeing more threads than cores, then stops
    the training thread's OpenMP threads from spinning between ops: every small op of eager
    PyTorch waited for a wake-up, for the rest of the process (a sum over [2048, 256] 18 -> 66
    us; an eager step of a small Mixtral 20 -> 38 ms; eager peers in the benchmarks alike)."""
    global _thread
    while True:
        try:
            build, future, start = _jobs.get(timeout=_IDLE_SECONDS)
        except queue.Empty:
            with _started:  # where `_queue` puts jobs: none is put while this thread ends
                if _jobs.empty():
                    _thread = None
                    return
            continue
        start.wait(_BACKWARD_PATIENCE)
        with _started:
            _waiting.discard(start)
        with _idle:
            if _closing.is_set():
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(build())
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)
            # The job holds the build's inputs (a snapshot of the call's tensors): dropped
            # before the next job arrives, then what the build freed goes back (`heap.py`).
            del build, future, start
            heap.release_freed_memory()


@atexit.register
def _close() -> None:
    _closing.set()
    turns.stop_waiting()
    # Queued builds are dropped here, on the exiting thread, before the interpreter finalizes:
    # the builder thread, taking the next job, freed the last one's tensors after that began,
    # and torch's deallocation, retaking the GIL, ended the thread inside C++ (the abort above).
    dropped = []
    with contextlib.suppress(queue.Empty):
        while True:
            dropped.append(_jobs.get_nowait())
    for _, future, _ in dropped:
        future.cancel()
    with _idle:  # the running build ends
        pass


def submit(build: Callable[[], T],
           start: threading.Event | None = None) -> concurrent.futures.Future[T]:
    """Queue `build()` for the builder thread, to start once `start` is set (at most
    `_BACKWARD_PATIENCE` seconds later), by default once the backward running on this thread
    (if any) has ended; its future."""
    if start is None and private.in_backward():
        start = threading.Event()
        private.queue_at_backward_end(start.set)
    return _queue(build, start or _NOW)


def run(build: Callable[[], T]) -> T:
    """`build()` on the builder thread, now; its result, or its exception."""
    with _started:
        for start in _waiting:
            start.set()
        _waiting.clear()
    started = time.perf_counter()
    try:
        with user_code.lent():  # this thread's eager runs, if any, wait with it
            return _queue(build, _NOW).result()
    finally:
        clock.add_build_wait(time.perf_counter() - started)


def _queue(build: Callable[[], T], start: threading.Event) -> concurrent.futures.Future[T]:
    global _thread
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_work, name="lazygrad-builder", daemon=True)
            _thread.start()
        if not start.is_set():
            _waiting.add(start)
        _jobs.put((build, future, start))
    return future


@contextlib.contextmanager
def autocast(state: Iterable[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    """The autocast state of a captured call ((device, enabled, dtype) as in a `Signature`):
    thread-local, and part of what is traced, so a trace on the builder thread sets it."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
