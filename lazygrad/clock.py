"""Where a training step's time goes: the wall time of a lazy model's forward and backward,
and the part of it spent inside ONNX Runtime's runs (measured around each run, not estimated).

ORT's time is one process-wide total, read before and after a window: with several lazy models
running at once in other threads, their runs count in each other's windows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from lazygrad.capture.private import queue_at_backward_end

_lock = threading.Lock()
_ort_seconds = 0.0


def add_ort(seconds: float) -> None:
    global _ort_seconds
    with _lock:
        _ort_seconds += seconds


def ort_seconds() -> float:
    """Seconds spent inside ORT's runs in this process so far."""
    return _ort_seconds


def time_backward(outputs: list[torch.Tensor], record: Callable[[float, float], None]) -> None:
    """Call `record(wall seconds, ORT seconds)` for the backward that reaches these outputs:
    from the first of their gradients to the end of that backward (autograd's engine
    callback). Tensor hooks only: the outputs stay the tensors they are (no extra view node)."""
    state = {"armed": True}

    def started(grad: torch.Tensor) -> torch.Tensor:
        if state["armed"]:
            state["armed"] = False
            wall, ort = time.perf_counter(), _ort_seconds
            queue_at_backward_end(lambda: record(time.perf_counter() - wall, _ort_seconds - ort))
        return grad

    for output in outputs:
        output.register_hook(started)
