"""torch's warnings about lazygrad's own trace and export, not about the user's code, unshown.

AOTAutograd traces the backward under anomaly mode, so a backward that cannot be traced (one
that reads a tensor's value) warns "Error detected in ...Backward" before the error lazygrad
reports as its own reason, and the exporter may warn about its translations. The warning
filters are the process's: `catch_warnings` swapped the whole list for its time, so while a
background build exported, the training loop's own warnings on the other thread were ignored
too (41 of 1430 in a helper's probe), and two threads inside it at once could leave one's list
in place for good. Instead one filter, at the front of the list, ignores warnings on the
threads inside `ignoring` alone: its message pattern is an object whose `match` asks which
thread is warning (the warnings machinery calls `match` on whatever pattern a filter holds).
It stays in the list (and in the copies `catch_warnings` makes), matching nothing elsewhere.
The lock keeps the exporter's module globals to one thread at a time.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

_lock = threading.RLock()


class _OnQuietThreads:
    """A filter's message pattern: matches on a thread inside `ignoring`, where the message
    starts with one of that thread's prefixes (any message, given none)."""

    # As a compiled pattern's, for code that reads the filters (a filter list printed).
    pattern = "(lazygrad: a warning of its trace or export)"

    def __init__(self) -> None:
        self._local = threading.local()

    def match(self, message: str) -> bool:
        prefixes = getattr(self._local, "prefixes", None)
        return prefixes is not None and (not prefixes or message.startswith(prefixes))

    @contextlib.contextmanager
    def on_this_thread(self, prefixes: tuple[str, ...]) -> Iterator[None]:
        outer = getattr(self._local, "prefixes", None)
        self._local.prefixes = prefixes
        try:
            yield
        finally:
            self._local.prefixes = outer


_pattern = _OnQuietThreads()
_FILTER = ("ignore", _pattern, Warning, None, 0)


@contextlib.contextmanager
def ignoring(*messages: str) -> Iterator[None]:
    """Warnings on this thread whose messages start with one of `messages` (every warning
    without any) are not shown inside; one thread at a time."""
    with _lock:
        if warnings.filters[:1] != [_FILTER]:  # first, as the user's "error" must not apply
            with contextlib.suppress(ValueError):
                warnings.filters.remove(_FILTER)
            # An ignore filter changes nothing already shown: no registry to invalidate.
            warnings.filters.insert(0, _FILTER)
        with _pattern.on_this_thread(messages):
            yield
