"""Give the memory a build freed back to the system (glibc's `malloc_trim`).

A build (trace, export, the check's runs in ORT and torch) allocates hundreds of MiB in small
and mid-sized blocks, on the builder thread's malloc arena and ORT's threads' arenas. Once it
ends they are free, but glibc returns to the system only the free memory at the top of each
heap, so most of it stayed resident for the rest of the process: 480 MiB after the build on the
BERT-shaped workload A of `benchmarks/memory.py`, raising every later step's peak by 120 MiB.
`malloc_trim(0)` releases the free pages inside every arena too. It runs after each build, on
the builder thread, and in the build's check (`verify.py`): first, as the last step's freed pages
would sit beside ORT's forward results (cold B del 1585 -> 1317 MiB), and between torch's runs and
ORT's, where the pages torch freed sat beside ORT's new allocations (the check's peak on cold B
1811 -> 1558 MiB). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None


def release_freed_memory() -> None:
    """Return the process's freed heap pages to the system, where the C library can."""
    trim = _trim()
    if trim is not None:
        trim(0)
