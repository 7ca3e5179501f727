"""Lazy calls inside a non-reentrant `torch.utils.checkpoint` region: the region's
recomputation runs each call the way its forward ran it.

torch recomputes a checkpointed region in the backward and requires the recomputation to save
what the forward saved (as many tensors, of the same shapes and types). A lazy call may run
another way the second time: a first call runs in eager PyTorch behind a probe whose backward
builds its graphs (in that same backward, before the recomputation), and a forecast may plan
another mask for the next call. A lazy class under checkpointing crashed the backward
(`CheckpointError`: recomputed tensors of other shapes), and a lazy instance in a region ran as
its plain self, silently: layers made lazy that the caller checkpoints
(`checkpoint(layer, x, use_reentrant=False)`, `checkpoint_sequential`, transformers 4's
`gradient_checkpointing_enable()`) ran nothing through ORT. (transformers 5 checkpoints inside
a layer's own forward: a lazy layer there traces the region, as a lazy model does.)

So each lazy call in a region's forward takes a slot in the region's frame, in the order the
calls start (an outer call before the parts it calls), and the call fills it where ORT served
it (`serving`, `served`): with how to run the same step again. The recomputation's lazy calls
take the slots in the same order (`recomputed_call`): the same step on the recomputed inputs
(torch restores the generator first, so its draws are the forward's), or, where the forward ran
in eager PyTorch for whatever reason, the module's plain forward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

Replay = Callable[[tuple, dict], Any]  # (args, kwargs) -> the call's result, as served

_CALLS = "_lazygrad_calls"  # on a region's frame: a slot per lazy call of its forward
_REPLAYED = "_lazygrad_replayed"  # on a region's frame: slots taken, per recomputation

_open = threading.local()  # the region calls running on this thread, innermost last


@contextlib.contextmanager
def forward_call(frame: Any, runtime: object) -> Iterator[None]:
    """A call of `runtime` in the forward of the region `frame`: its slot, empty (the module's
    plain forward) unless `served` fills it while the call runs."""
    calls = frame.__dict__.setdefault(_CALLS, [])
    calls.append(None)
    running = _open.__dict__.setdefault("calls", [])
    running.append((calls, len(calls) - 1, runtime))
    try:
        yield
    finally:
        running.pop()


def serving(runtime: object) -> bool:
    """Whether `runtime`'s call is the innermost region call on this thread: the way it runs
    is kept (`served`). Asked first, so that a call outside any region makes no replay."""
    running = getattr(_open, "calls", None)
    return bool(running) and running[-1][2] is runtime


def served(replay: Replay) -> None:
    """The innermost region call on this thread ran through ORT (`serving`): its
    recomputation runs `replay`."""
    calls, index, _ = _open.calls[-1]
    calls[index] = replay


def recomputed_call(frame: Any, recomputation: object) -> Replay | None:
    """How the next lazy call of this recomputation of `frame` ran in the forward: its replay,
    or None (the module's plain forward)."""
    taken = frame.__dict__.setdefault(_REPLAYED, {})
    index = taken.get(recomputation, 0)
    taken[recomputation] = index + 1
    calls = frame.__dict__.get(_CALLS, [])
    return calls[index] if index < len(calls) else None
