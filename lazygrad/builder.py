"""Builds run on one process-wide builder thread, never inside the caller's autograd call.

A mask first seen at backward is built from inside that backward; tracing there is a backward
inside a backward, and with another thread's backward running at the same time AOTAutograd's
process-global node-metadata bookkeeping broke ("Expected current_level > 0"). On a thread of
its own the trace never nests in an autograd call, and traces never overlap. The caller's
autocast state (thread-local, and part of what is traced) is carried over.
"""

from __future__ import annotations

import contextlib
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazygrad")
_DEVICES = ("cpu", "cuda")


def run(build: Callable[[], T]) -> T:
    """`build()` on the builder thread, under the caller's autocast state; its result or error."""
    autocast = [
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _DEVICES
    ]

    def under_callers_state() -> T:
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in autocast:
                if enabled:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
            return build()

    return _executor.submit(under_callers_state).result()
