"""Builds run on one process-wide builder thread, never inside the caller's autograd call.

A mask first seen at backward is built from inside that backward; tracing there is a backward
inside a backward, and with another thread's backward running at the same time AOTAutograd's
process-global node-metadata bookkeeping broke ("Expected current_level > 0"). On a thread of
its own the trace never nests in an autograd call, and traces never overlap.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazygrad")


def run(build: Callable[[], T]) -> T:
    """`build()` on the builder thread; its result, or its exception."""
    return _executor.submit(build).result()


@contextlib.contextmanager
def autocast(state: Iterable[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    """The autocast state of a captured call ((device, enabled, dtype) as in a `Signature`):
    thread-local, and part of what is traced, so a trace on the builder thread sets it."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
