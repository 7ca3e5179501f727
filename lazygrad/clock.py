"""Where a training step's time goes: the wall time of a lazy model's forward and backward,
less the time it blocked on a build, and the part of it spent inside ONNX Runtime's runs
(measured around each run, not estimated).

A step that waits for its graphs (`Options.wait_for_builds`, strict mode) spends seconds
building; counted as step time, they made a short run's share inside ORT look small (the demo's
three builds: 8% of its forward and backward inside ORT, where its steps ran through ORT from
the second on). A build's time is reported as the build's (`EntryStats.build_seconds`).

ORT's time is a process-wide total, read before and after a window: with several lazy models
running at once in other threads, their runs count in each other's windows. The time blocked on
builds is the thread's own, so another thread's wait is never taken off a step's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from lazygrad.capture.private import queue_at_backward_end

_lock = threading.Lock()
_ort_seconds = 0.0
_waited = threading.local()  # .seconds: this thread's time blocked on builds


def add_ort(seconds: float) -> None:
    global _ort_seconds
    with _lock:
        _ort_seconds += seconds


def add_build_wait(seconds: float) -> None:
    """The calling thread's step blocked this long on a build."""
    _waited.seconds = _thread_waited() + seconds


def _thread_waited() -> float:
    return getattr(_waited, "seconds", 0.0)


class Window:
    """A stretch of a step, from its creation to `close`."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._wall, self._ort, self._waited = time.perf_counter(), _ort_seconds, _thread_waited()

    def close(self) -> tuple[float, float]:
        """(the wall seconds since it opened, less those this thread blocked on builds; ORT's
        seconds). A window closed on another thread than it opened on (a backward's end run
        by another of autograd's threads) keeps its wait."""
        waited = _thread_waited() - self._waited if threading.get_ident() == self._thread else 0.0
        return time.perf_counter() - self._wall - waited, _ort_seconds - self._ort


def time_backward(outputs: list[torch.Tensor], record: Callable[[float, float], None]) -> None:
    """Call `record(wall seconds, ORT seconds)` for the backward that reaches these outputs:
    from the first of their gradients to the end of that backward (autograd's engine
    callback). Tensor hooks only: the outputs stay the tensors they are (no extra view node)."""
    state = {"armed": True}

    def started(grad: torch.Tensor) -> torch.Tensor:
        if state["armed"]:
            state["armed"] = False
            window = Window()
            queue_at_backward_end(lambda: record(*window.close()))
        return grad

    for output in outputs:
        output.register_hook(started)
