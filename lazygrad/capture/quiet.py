"""torch's warnings about lazygrad's own trace and export, not about the user's code, unshown.

AOTAutograd traces the backward under anomaly mode, so a backward that cannot be traced (one
that reads a tensor's value) warns "Error detected in ...Backward" before the error lazygrad
reports as its own reason, and the exporter warns about its translations. `catch_warnings`
swaps the process's filter list for its time: two threads inside it at once can leave one's
list in place for good (every warning of the process ignored after an export), so the trace
and the export take one lock for it, which also keeps the exporter's module globals (and
`sys.stdout`, redirected around it) to one thread at a time.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

_lock = threading.RLock()


@contextlib.contextmanager
def ignoring(*messages: str) -> Iterator[None]:
    """Warnings whose messages start with one of `messages` (every warning without any) are not
    shown inside; one thread at a time."""
    with _lock, warnings.catch_warnings():
        if not messages:
            warnings.simplefilter("ignore")
        for message in messages:
            warnings.filterwarnings("ignore", message=message)
        yield
