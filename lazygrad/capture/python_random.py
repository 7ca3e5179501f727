"""Draws from Python's or NumPy's global random generators while tracing: refused.

A trace runs the forward's Python once, so a draw made there (teacher forcing decided by
`random.random() < ratio` in a seq2seq model's forward, a layer skipped on `np.random.uniform()`)
becomes a constant of the graph: every ORT step would take the branch the trace took, where
eager draws again at each call. torch's own random ops are drawn per step (`draws.py`); these
generators cannot be. While a trace runs, the functions of the `random` and `numpy.random`
modules record a call made from the tracing thread (other threads, a data loader's, draw as
usual and are not counted), and a call that drew makes the capture fail, so the module runs in
parts or eagerly. A function imported by name before (`from random import random`) is not seen.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from lazygrad.capture.errors import CaptureError

_STATE = {"getstate", "setstate", "seed", "get_state", "set_state"}


@contextlib.contextmanager
def refusing_draws() -> Iterator[None]:
    """Inside, a draw from the tracing thread is recorded; on a clean exit, one raises."""
    drawn: list[str] = []
    thread = threading.get_ident()
    swapped: list[tuple[ModuleType, str, Callable[..., Any]]] = []
    for module in _generators():
        for name, function in list(vars(module).items()):
            if name in _STATE or getattr(function, "__self__", None) is not _owner(module):
                continue
            setattr(module, name, _recording(function, f"{module.__name__}.{name}", thread, drawn))
            swapped.append((module, name, function))
    try:
        yield
    finally:
        for module, name, function in swapped:
            setattr(module, name, function)
    if drawn:
        raise CaptureError(
            f"the forward draws from a global random generator ({', '.join(sorted(set(drawn)))}): "
            "a graph would replay the trace's draw at every step, where eager draws at each call"
        )


def _generators() -> list[ModuleType]:
    found = [random]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        found.append(numpy_random)
    return found


def _owner(module: ModuleType) -> object:
    """The generator whose bound methods the module exposes as functions."""
    if module is random:
        return random._inst  # type: ignore[attr-defined]
    return module.mtrand._rand  # type: ignore[attr-defined]


def _recording(function: Callable[..., Any], name: str, thread: int,
               drawn: list[str]) -> Callable[..., Any]:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            drawn.append(name)
        return function(*args, **kwargs)

    return recorded
