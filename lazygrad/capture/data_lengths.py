"""Lengths made as each call's data says: which lines of code the trace must make otherwise.

An op whose result's length is read from data (`selections.py`) that the trace does not answer
with the first call's length (`checks.py`) makes a size the trace does not know, a symbol
without a value (unbacked): the graph computes it at every call (ONNX's NonZero), so one graph
serves every length, as token routing gives each expert another count of tokens at every step.
torch's reasoning on such a size holds for every value it may take, with two exceptions, which
name the lines of code (file, line) whose lengths must be the first call's instead:

- a branch on the length (`if tokens.shape[0] == 0: continue`; a loop over a tensor's rows):
  the trace fails on it (`GuardOnDataDependentSymNode`);
- a condition torch assumed of it and would assert at run time (a reshape by it that divides,
  `torch._check`): a graph runs no such assertion.

The trace binds each symbol it made this way to its line and to the pass of the forward that
made it (AOTAutograd runs the forward twice: an assertion relating its two passes' symbols, as
its check that an output's size came out the same both times, holds by construction).
"""

from __future__ import annotations

import threading
from typing import Any

from lazygrad.capture import private

# (file, line) of code that made a length from data
Line = tuple[str, int]

_state = threading.local()


def start() -> None:
    """A new trace: no symbol is bound yet."""
    _state.bound, _state.passes = {}, 0


def next_pass() -> int:
    """A new run of the forward within the trace; its number."""
    _state.passes += 1
    return _state.passes


def bind(length: Any, line: Line, forward_pass: int) -> None:
    """`length`, an op's result's length made from data at `line`, in `forward_pass`."""
    for symbol in private.free_unbacked_symbols(length):
        _state.bound[symbol] = (line, forward_pass)


def lines_branched_on(error: BaseException) -> frozenset[Line]:
    """The lines whose lengths the trace that raised `error` branched on (none if it did not
    fail on a branch on a length from data)."""
    while error is not None and not isinstance(error, private.GuardOnDataDependentSymNode):
        error = error.__cause__ or error.__context__
    if error is None:
        return frozenset()
    return frozenset(line for line, _ in _bound(error.cond.free_symbols))


def lines_assumed(shape_env: Any) -> tuple[frozenset[Line], bool]:
    """The lines whose lengths the last trace assumed a condition of (those of one pass), and
    whether it assumed one of a size from data that no such line made (a read inside torch's
    C++, an op not in `selections.py`)."""
    lines: set[Line] = set()
    unknown = False
    for asserts in shape_env.deferred_runtime_asserts.values():
        for assertion in asserts:
            symbols = private.free_unbacked_symbols(assertion.expr)
            bound = _bound(symbols)
            if len(bound) < len(symbols):
                unknown = True
            elif len({forward_pass for _, forward_pass in bound}) == 1:
                lines.update(line for line, _ in bound)
    return frozenset(lines), unknown


def _bound(symbols: Any) -> list[tuple[Line, int]]:
    bound = getattr(_state, "bound", {})
    return [bound[symbol] for symbol in symbols if symbol in bound]
