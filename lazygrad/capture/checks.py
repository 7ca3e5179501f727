"""The argument checks a forward makes on tensor values, kept as a result of its graph.

`torch.distributions` checks its arguments and samples at every call (`validate_args`, on by
default): `if not torch._is_all_true(scale > 0): raise ValueError(...)`. A trace cannot branch
on a value, so a model that made a `Normal` or a `Categorical` in its forward (a VAE, a policy,
a flow's base density) ran in parts. torch.compile turns the checks off for the whole process;
here each check's tensor is kept instead, the trace goes on as if it held, and the graph returns
whether all held (`Functional`): a call where one did not runs again in eager PyTorch, which
raises the distribution's own error (`GraphPair.forward`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While a trace runs: `torch._is_all_true`, called by the traced forward (`kept` open on
    the tracing thread), keeps its tensor and answers True. Elsewhere (another thread's eager
    code) it checks. One trace at a time (`trace._lock`)."""
    checking = torch._is_all_true
    tracing = threading.get_ident()

    def keep(tensor: torch.Tensor) -> object:
        kept = getattr(_state, "kept", None)
        if kept is None or threading.get_ident() != tracing:
            return checking(tensor)
        kept.append(tensor)
        return True

    torch._is_all_true = keep
    try:
        yield
    finally:
        torch._is_all_true = checking


@contextlib.contextmanager
def kept() -> Iterator[list[torch.Tensor]]:
    """The checks the forward run in this block defers (`deferred`), in order."""
    previous = getattr(_state, "kept", None)
    _state.kept = checks = []
    try:
        yield checks
    finally:
        _state.kept = previous


def all_held(checks: list[torch.Tensor]) -> torch.Tensor:
    """One boolean: whether every check held."""
    return torch.stack([check.all() for check in checks]).all()
