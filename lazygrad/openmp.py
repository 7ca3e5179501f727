"""End torch's spinning OpenMP threads before ORT takes the cores (`omp_pause_resource_all`).

After a parallel op, torch's OpenMP threads spin for milliseconds, waiting for the next one
(libgomp's default wait policy). An ORT run started then shares the cores with them, and MLAS
splits a product evenly between ORT's threads, so the thread beside a spinner sets the pace: a
[768, 1024] x [1024, 768] product took 13.5 ms right after a torch op against 6.6 ms alone
(`benchmarks/faults.py` measures the vocabulary head's products so). A lazygrad step starts its
ORT runs right after torch's ops (the forward after the optimizer, the backward after the loss's
own backward), which eager never does. `omp_pause_resource_all(omp_pause_soft)` (OpenMP 5.0)
ends the calling thread's pool of OpenMP threads: the spinners exit, and torch's next parallel op
starts new ones, as its first op did. Measured: 20-30 us where there is a pool, 1 us where
there is none (no parallel op since), and 35-45 us more for torch's next parallel op. Only GNU's
runtime, where the pool is the calling thread's (a pause inside a parallel region is refused by
the runtime itself); nothing elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_SOFT = 1  # omp_pause_soft: the threads end; the runtime starts them again when next needed
ENABLED = True  # `python -m benchmarks.steady --no-openmp-pause` measures the runs without it


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """GNU's `omp_pause_resource_all`, where torch's OpenMP runtime is GNU's (Linux wheels):
    its pause ends the calling thread's pool only (libgomp's `gomp_pause_host`). Not LLVM's or
    Intel's (macOS, some conda builds), whose pause is neither read nor measured here."""
    try:
        process = ctypes.CDLL(None)
    except (OSError, TypeError):  # Windows: no process-wide namespace to look in
        return None
    if not hasattr(process, "GOMP_parallel") or hasattr(process, "__kmpc_fork_call"):
        return None
    pause = getattr(process, "omp_pause_resource_all", None)  # OpenMP 5.0, GCC 9 and later
    if pause is not None:
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def end_spinning_threads() -> None:
    """End the calling thread's OpenMP threads, which may be spinning after torch's last op."""
    pause = _pause()
    if pause is not None and ENABLED:
        pause(_SOFT)
