"""The argument checks a forward makes on tensor values, kept as a result of its graph.

`torch.distributions` checks its arguments and samples at every call (`validate_args`, on by
default): `if not torch._is_all_true(scale > 0): raise ValueError(...)`. A trace cannot branch
on a value, so a model that made a `Normal` or a `Categorical` in its forward (a VAE, a policy,
a flow's base density) ran in parts. torch.compile turns the checks off for the whole process;
here each check's tensor is kept instead, the trace goes on as if it held, and the graph returns
whether all held (`Functional`): a call where one did not runs again in eager PyTorch, which
raises the distribution's own error (`GraphPair.forward`).

The index arguments eager's kernels check are kept alike (`_IndexChecks`): ONNX's Gather,
GatherElements, ScatterElements and OneHot take a negative index from the end, where
`embedding`, `gather`, `index_select`, `scatter`, `index_add`, `one_hot` and the class targets
of `cross_entropy` and `nll_loss` raise in eager; a token id or a label of -1 (a padding value
mistaken for `ignore_index`) trained silently on the last row or class. A call with an index
out of its range runs again in eager PyTorch, which raises eager's error.

A branch on a tensor's value (`if torch.isinf(h).any() or torch.isnan(h).any(): h = h.clamp(...)`
in DETR's encoder layers; `if mask.any():`) is taken as the signature's first call took it:
that call runs in eager PyTorch, and `recording` keeps what each `bool(tensor)` it made
returned, by the line of code that made it (and its count there: a layer's line runs once per
layer). The trace answers a `bool(tensor)` made at a recorded line with the recorded value and
keeps the check that the tensor gives that value (`_Branches`), so a later call that would take
the other branch runs again in eager PyTorch, as torch.compile guards a value it specialised
on. The check alone makes the graph right: the record only chooses which branch to build.
Before, a trace that met such a branch failed and the submodule ran eagerly.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lazygrad.capture import private

_state = threading.local()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While a trace runs: `torch._is_all_true`, called by the traced forward (`kept` open on
    the tracing thread), keeps its tensor and answers True; `bool(tensor)` of a traced tensor
    (AOTAutograd's functional tensors) is answered by the first call's branches where `kept`
    was given them. Elsewhere (another thread's eager code) both act as ever. One trace at a
    time (`trace._lock`)."""
    checking = torch._is_all_true
    functional = private.FunctionalTensor
    truth = functional.__bool__
    tracing = threading.get_ident()

    def keep(tensor: torch.Tensor) -> object:
        kept = getattr(_state, "kept", None)
        if kept is None or threading.get_ident() != tracing:
            return checking(tensor)
        kept.append(tensor)
        return True

    def answered(tensor: torch.Tensor) -> bool:
        branches = getattr(_state, "branches", None)
        if branches is not None and threading.get_ident() == tracing:
            value = branches.answer(tensor, sys._getframe(1))
            if value is not None:
                return value
        return truth(tensor)

    torch._is_all_true = keep
    functional.__bool__ = answered
    try:
        with _IndexChecks():
            yield
    finally:
        torch._is_all_true = checking
        functional.__bool__ = truth


@contextlib.contextmanager
def kept(branches: Branches | None = None) -> Iterator[list[torch.Tensor]]:
    """The checks the forward run in this block defers (`deferred`), in order. `branches`: what
    each `bool(tensor)` of the first call returned (`recording`), which answers the trace's
    (None: unknown; a branch on a value then fails the trace)."""
    previous = getattr(_state, "kept", None), getattr(_state, "branches", None)
    _state.kept = checks = []
    _state.branches = None if branches is None else _Branches(branches)
    try:
        yield checks
    finally:
        _state.kept, _state.branches = previous


def all_held(checks: list[torch.Tensor]) -> torch.Tensor:
    """One boolean: whether every check held."""
    return torch.stack([check.all() for check in checks]).all()


# (file, line, count at that line) of each `bool(tensor)` a call made -> what it returned
Branches = tuple[tuple[str, int, int, bool], ...]


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, int, int, bool]]]:
    """What each `bool(tensor)` made in this block (on this thread) returned, by where it was
    made (`Branches`). `Tensor.__bool__` is wrapped while any thread records: a torch function
    mode would do, but an active mode turns off eager's fast paths (`nn.TransformerEncoder`'s
    nested tensors), and the call must be eager's own."""
    values: list[tuple[str, int, int, bool]] = []
    recorders = _state.__dict__.setdefault("recorders", [])
    recorders.append((values, {}))
    with _truth_recorded():
        try:
            yield values
        finally:
            recorders.pop()


_recording = threading.Lock()
_recording_threads = 0


@contextlib.contextmanager
def _truth_recorded() -> Iterator[None]:
    """`Tensor.__bool__` records (`_recorded_truth`) while any thread is in this block."""
    global _recording_threads
    with _recording:
        if _recording_threads == 0:
            torch.Tensor.__bool__ = _recorded_truth  # type: ignore[method-assign]
        _recording_threads += 1
    try:
        yield
    finally:
        with _recording:
            _recording_threads -= 1
            if _recording_threads == 0:
                del torch.Tensor.__bool__


def _recorded_truth(tensor: torch.Tensor) -> bool:
    """`bool(tensor)`, kept by this thread's recordings (none on other threads)."""
    value = torch._C.TensorBase.__bool__(tensor)
    for values, counts in getattr(_state, "recorders", ()):  # called by the frame above
        values.append((*_site(sys._getframe(1), counts), value))
    return value


def _site(frame: Any, counts: dict[tuple[str, int], int]) -> tuple[str, int, int]:
    """Where `frame` is (its file and line), and how many times that line was met before."""
    line = (frame.f_code.co_filename, frame.f_lineno)
    count = counts.get(line, 0)
    counts[line] = count + 1
    return (*line, count)


class _Branches:
    """The trace's answers to `bool(tensor)`: the first call's at the same place, each kept as
    a check that the tensor gives it."""

    def __init__(self, values: Branches) -> None:
        self.values = {(file, line, count): value for file, line, count, value in values}
        self._counts: dict[tuple[str, int], int] = {}

    def answer(self, tensor: torch.Tensor, frame: Any) -> bool | None:
        """The recorded value where `frame` made a `bool(tensor)` the first call made too
        (kept as a check), else None."""
        value = self.values.get(_site(frame, self._counts))
        if value is not None:
            held = tensor if tensor.dtype == torch.bool else tensor != 0
            torch._is_all_true(held if value else held.logical_not())
        return value


def _in_range(index: torch.Tensor, size: int, allowed: int | None = None) -> torch.Tensor:
    held = (index >= 0) & (index < size)
    return held if allowed is None else held | (index == allowed)


def _along(dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return _in_range(index, source.shape[dim])


def _classes(input: torch.Tensor, target: torch.Tensor, weight: Any = None,
             size_average: Any = None, ignore_index: int = -100, *_: Any,
             **__: Any) -> torch.Tensor | None:
    """`cross_entropy`'s and `nll_loss`'s targets, by their parameters' order."""
    if target.is_floating_point():  # class probabilities, not indices
        return None
    return _in_range(target, input.shape[1 if input.dim() > 1 else 0], ignore_index)


# function -> the check of its index arguments, from the call's (args, kwargs), or None. Not
# `index_fill`, `take_along_dim` and indexing (`x[rows]`), which take -1 from the end in eager.
_CHECKS: dict[Any, Callable[[tuple, dict], torch.Tensor | None]] = {
    F.embedding: lambda a, k: _in_range(a[0], (a[1] if len(a) > 1 else k["weight"]).shape[0]),
    torch.embedding: lambda a, k: _in_range(a[1], a[0].shape[0]),
    F.one_hot: lambda a, k: None if (n := a[1] if len(a) > 1 else k.get("num_classes", -1)) < 0
    else _in_range(a[0], n),
    F.cross_entropy: lambda a, k: _classes(*a, **k),
    F.nll_loss: lambda a, k: _classes(*a, **k),
    **{function: lambda a, k: _along(_dim(a, k), _index(a, k), a[0]) for function in (
        torch.gather, torch.Tensor.gather, torch.index_select, torch.Tensor.index_select,
        torch.Tensor.scatter, torch.Tensor.scatter_, torch.scatter, torch.Tensor.scatter_add,
        torch.Tensor.scatter_add_, torch.scatter_add, torch.Tensor.scatter_reduce,
        torch.Tensor.scatter_reduce_, torch.scatter_reduce, torch.Tensor.index_add,
        torch.Tensor.index_add_, torch.index_add, torch.Tensor.index_copy,
        torch.Tensor.index_copy_, torch.index_copy)},
}


def _dim(args: tuple, kwargs: dict) -> int:
    return args[1] if len(args) > 1 else kwargs["dim"]


def _index(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[2] if len(args) > 2 else kwargs["index"]


class _IndexChecks(TorchFunctionMode):
    """While a forward runs in a trace (`kept` open): the index arguments of the functions in
    `_CHECKS` are kept as checks (`_is_all_true`, which `deferred` keeps)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        check = _CHECKS.get(func)
        if check is not None and getattr(_state, "kept", None) is not None:
            try:
                held = check(args, kwargs)
            except (IndexError, KeyError, AttributeError, TypeError):
                held = None  # arguments in a form not read here: the op itself judges them
            if held is not None:
                torch._is_all_true(held)
        return func(*args, **kwargs)
