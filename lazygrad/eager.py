"""Eager mode: within it every lazy module runs its original PyTorch forward.

Used while tracing (a lazy submodule must be traced, not run through ORT), for a first step
that runs eagerly, and for fallback. Thread-local, so one thread's trace does not make another
thread's calls eager.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def eager_mode() -> Iterator[None]:
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def in_eager_mode() -> bool:
    return getattr(_state, "active", False)
