"""A background build's check runs between two training steps, so that their peaks never add.

The check (`verify.py`) runs the new graphs in ORT and their FX graphs in torch on a real batch:
about as much memory as a training step. Beside the eager steps that tiered execution runs while
the graphs are built, the two peaks added up (the whole-process peak of workload A in
`benchmarks/memory.py`). So the check waits for the training thread to start its next call of a
lazy module, and that thread waits there until the check is done: one step pauses for a check's
run, once per build. At that point the previous step is over (its backward, the optimizer's step,
`zero_grad`), and what the loop let go of (its outputs, in a loop that deletes them) is freed:
the check's peak stands on the least a loop holds. (It waited for the end of a backward before,
where the step's outputs and gradients are all alive: workload A's cold peak in a `del` loop was
1.44x eager's.) A check waits at most `patience` seconds for a call (a loop that makes none),
then runs anyway. Builds run one at a time (`builder.py`), so at most one check waits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_condition = threading.Condition()
_waiting = False  # a check waits for its turn
_granted = False  # a training thread paused at the start of its call for the check
_closing = False  # the process exits: a check waits no longer
_idle = 0  # threads waiting for builds (`between_steps`): no step of theirs holds memory


@contextlib.contextmanager
def check_turn(patience: float = 60.0) -> Iterator[None]:
    """Inside: a training thread that started a call waits (if one did within `patience`
    seconds)."""
    global _waiting, _granted
    with _condition:
        _waiting = True
        try:
            _condition.wait_for(lambda: _granted or _closing or _idle, timeout=patience)
        finally:
            _waiting = False
    try:
        yield
    finally:
        with _condition:
            _granted = False
            _condition.notify_all()


def call_starting() -> None:
    """At the start of a call of a lazy module by the training code (not from inside another
    lazy module's forward), on its thread: a check waiting for its turn runs now, and this thread
    waits until it is done."""
    global _granted
    if not _waiting:  # nothing waits (every call passes here: no lock then)
        return
    with _condition:
        if not _waiting or _granted:
            return
        _granted = True
        _condition.notify_all()
        _condition.wait_for(lambda: not _granted)


@contextlib.contextmanager
def between_steps() -> Iterator[None]:
    """Around a thread's wait for builds (`lazygrad.wait_for_builds`): it is between two steps,
    so a check waiting for its turn runs now, not after its patience (a loop that waits for its
    graphs runs no backward meanwhile)."""
    global _idle
    with _condition:
        _idle += 1
        _condition.notify_all()
    try:
        yield
    finally:
        with _condition:
            _idle -= 1


def stop_waiting() -> None:
    """At exit: a check waiting for its turn runs now (the build ends sooner)."""
    global _closing
    with _condition:
        _closing = True
        _condition.notify_all()
