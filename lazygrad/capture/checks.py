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
out of its range runs again in eager PyTorch, which raises eager's error. The picks of a
top-k, a median along a dimension and a k-th value are kept alike, checked free of ties
(`_PICKS`): among equal values eager's kernels pick in an order ORT does not follow, so such a
call runs in eager PyTorch too, and a first call with one, whose graphs would not be eager's on
it, is recorded (`Recording.ties`) and builds nothing.

A value read from a tensor is taken as the signature's first call read it: a branch on a value
(`if torch.isinf(h).any() or torch.isnan(h).any(): h = h.clamp(...)` in DETR's encoder layers;
`if mask.any():`), and a number or list read as Python values (`n = int(mask.sum(1).max())`
to cut padding, `.item()`, `torch.split(x, lengths.tolist())` in Qwen2-VL's vision tower, the
grid sizes its rotary tables are made for). That call runs in eager PyTorch, and `recording`
keeps what each such read (`bool`, `int`, `float`, `operator.index`, `.item()`, `.tolist()`
of a tensor) returned, by the line of code that made it (and its count there: a layer's line
runs once per layer). The trace answers a read made at a recorded line with the recorded value
and keeps the check that the tensor still holds that value (`_Reads`), so a later call that
would read another runs again in eager PyTorch, as torch.compile guards a value it specialised
on. The check alone makes the graph right: the record only chooses what to build. Before, a
trace that met such a read failed and the submodule ran eagerly. Integers read by `item()` and
`tolist()` (JetMoE's counts of tokens per expert, split by), and the lengths of ops' results
(`selections.py`), are each call's instead, unknown to the trace (`data_lengths.py`), but at
the lines where that trace fails: there they are the first call's, as every other value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lazygrad.capture import data_lengths, private, selections
from lazygrad.capture.errors import CaptureError

_state = threading.local()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While a trace runs: `torch._is_all_true`, called by the traced forward (`kept` open on
    the tracing thread), keeps its tensor and answers True; a value read from a traced tensor
    (AOTAutograd's functional tensors: `_READERS`) is answered by the first call's reads where
    `kept` was given them. Elsewhere (another thread's eager code) both act as ever. One trace
    at a time (`trace._lock`)."""
    checking = torch._is_all_true
    functional = private.FunctionalTensor
    own = {name: functional.__dict__[name] for name in _READERS if name in functional.__dict__}
    tracing = threading.get_ident()

    def keep(tensor: torch.Tensor) -> object:
        kept = getattr(_state, "kept", None)
        if kept is None or threading.get_ident() != tracing:
            return checking(tensor)
        kept.append(tensor)
        return True

    def answering(name: str) -> Callable[[torch.Tensor], Any]:
        read = getattr(functional, name)

        def answered(tensor: torch.Tensor) -> Any:
            reads = getattr(_state, "reads", None)
            if reads is None or threading.get_ident() != tracing \
                    or getattr(_state, "reading", False):  # (`tolist` reads by `item`)
                return read(tensor)
            _state.reading = True
            try:
                return reads.answer(_caller(sys._getframe(1)), tensor, name, read)
            finally:
                _state.reading = False

        return answered

    def formatted(tensor: torch.Tensor, spec: str) -> str:
        """A 0-d tensor formatted as eager's `Tensor.__format__` formats one, by its number,
        which it reads for plain tensors only (a traced one was formatted as its repr:
        `self[f"expert_{index}"]`, Switch Transformers' and NLLB-MoE's pick of an expert,
        named none)."""
        if tensor.dim() == 0 and not tensor.is_complex() and threading.get_ident() == tracing:
            number = bool if tensor.dtype == torch.bool else \
                float if tensor.is_floating_point() else int
            return format(number(tensor), spec)
        return torch.Tensor.__format__(tensor, spec)

    torch._is_all_true = keep
    for name in _READERS:
        setattr(functional, name, answering(name))
    functional.__format__ = formatted
    try:
        with _IndexChecks(), data_lengths.tracing():
            yield
    finally:
        del functional.__format__
        torch._is_all_true = checking
        for name in _READERS:
            if name in own:
                setattr(functional, name, own[name])
            else:
                delattr(functional, name)


@contextlib.contextmanager
def kept(reads: Reads | None = None, fixed: Collection[data_lengths.Line] = ()
         ) -> Iterator[list[torch.Tensor]]:
    """The checks the forward run in this block defers (`deferred`), in order, and those of
    what it assumed of lengths from data (`data_lengths.py`). `reads`: what the first call read
    from tensors (`recording`), which answers the trace's reads (None: unknown; a read of a
    value then fails the trace); the lengths of ops' results and the integers read by
    `_SYMBOLIC_READERS` are each call's but at the lines `fixed`, where they are the first
    call's."""
    previous = getattr(_state, "kept", None), getattr(_state, "reads", None)
    _state.kept = checks = []
    with data_lengths.forward_pass() as number:
        _state.reads = None if reads is None else _Reads(reads, number, fixed)
        try:
            yield checks
            checks.extend(data_lengths.checks_of(number))
        finally:
            _state.kept, _state.reads = previous


def all_held(checks: list[torch.Tensor]) -> torch.Tensor:
    """One boolean: whether every check held."""
    return torch.stack([check.all() for check in checks]).all()


# The methods by which Python code reads a tensor's value: `if t:`, `int(t)`, `float(t)`,
# `operator.index(t)` (a tensor as an index or a size), `t.item()`, `t.tolist()`.
_READERS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")

# The ops whose output length is read from data (`selections.py`), by where code calls them.
_SIZED_OPS = ((torch, "nonzero"), (torch, "argwhere"), (torch, "where"), (torch, "masked_select"),
              (torch, "repeat_interleave"), (torch, "unique"), (torch.Tensor, "nonzero"),
              (torch.Tensor, "argwhere"), (torch.Tensor, "masked_select"),
              (torch.Tensor, "repeat_interleave"), (torch.Tensor, "unique"))

# The ops whose picks are checked for ties (`_PICKS`), by where code calls them.
_PICKING_OPS = tuple((owner, name) for name in ("topk", "median", "kthvalue")
                     for owner in (torch, torch.Tensor))

# A `tolist()` of more elements is not recorded (its trace then fails, as before): a list that
# long is data (token ids), which the next call would not repeat.
LARGEST_LIST = 4096

# (file, line, count at that line) of each value a call read from a tensor -> what it read,
# and whether a trace may make it each call's (`data_lengths.py`): the length of an op's result
# (`selections.py`), integers read by `item()` or `tolist()`
Reads = tuple[tuple[str, int, int, Any, bool], ...]

# The readers whose integers a trace may leave unknown (each call's): the others must return a
# Python number (`int(t)`, `operator.index(t)`) or are not integers
_SYMBOLIC_READERS = ("item", "tolist")


def lines_from_data(reads: Reads | None) -> frozenset[data_lengths.Line]:
    """The lines of code whose lengths or integers `reads` holds that a trace may make each
    call's."""
    return frozenset((read[0], read[1]) for read in reads or () if read[4])


@dataclasses.dataclass
class Recording:
    """What a call read from tensors (`Reads`, in order), and the lines (file, line) where a
    selection it made picked among equal values (`_PICKS`)."""

    reads: list[tuple[str, int, int, Any, bool]] = dataclasses.field(default_factory=list)
    ties: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """What each value read from a tensor in this block (on this thread) returned, and each
    length an op read from data (`selections.py`), by where it was read (`Reads`); and where a
    selection picked among equal values. The readers of `torch.Tensor` and those ops are wrapped
    while any thread records: a torch function mode would do, but an active mode turns off
    eager's inference fast paths (`nn.TransformerEncoder`'s nested tensors), and the call must
    be eager's own. Boolean-mask indexing is the exception (`_BooleanIndexRecorded`)."""
    recorded = Recording()
    recorders = _state.__dict__.setdefault("recorders", [])
    recorders.append((recorded, {}))
    indexing = _BooleanIndexRecorded() if torch.is_grad_enabled() and len(recorders) == 1 \
        else contextlib.nullcontext()
    with _reads_recorded(), indexing:
        try:
            yield recorded
        finally:
            recorders.pop()


_recording = threading.Lock()
_recording_threads = 0


@contextlib.contextmanager
def _reads_recorded() -> Iterator[None]:
    """`torch.Tensor`'s readers and the ops of `_SIZED_OPS` and `_PICKING_OPS` record
    (`_recorded`, `_length_recorded`, `_ties_recorded`) while any thread is in this block."""
    global _recording_threads
    with _recording:
        if _recording_threads == 0:
            for name in _READERS:  # `TensorBase`'s, inherited, outside the block
                setattr(torch.Tensor, name,
                        _recorded(name, getattr(torch._C.TensorBase, name)))
            for owner, name in _SIZED_OPS:
                setattr(owner, name, _length_recorded(name, getattr(owner, name)))
            for owner, name in _PICKING_OPS:
                op = getattr(owner, name)
                setattr(owner, name, _ties_recorded(op, _PICKS[op]))
        _recording_threads += 1
    try:
        yield
    finally:
        with _recording:
            _recording_threads -= 1
            if _recording_threads == 0:
                for name in _READERS:
                    delattr(torch.Tensor, name)
                for owner, name in (*_SIZED_OPS, *_PICKING_OPS):
                    original = getattr(owner, name).__wrapped__
                    if owner is torch.Tensor and original is getattr(torch._C.TensorBase, name,
                                                                     None):
                        delattr(owner, name)  # inherited again
                    else:
                        setattr(owner, name, original)


def _recorded(name: str, read: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    def recorded(tensor: torch.Tensor) -> Any:
        """The value read, kept by this thread's recordings (none on other threads), by the
        first frame outside torch's code (`Tensor.__format__` reads `item()` for the code
        that formats a tensor); once (a read under `_BooleanIndexRecorded` reaches this
        again, from the mode)."""
        if getattr(_state, "reading", False):
            return read(tensor)
        _state.reading = True
        try:
            value = read(tensor)
        finally:
            _state.reading = False
        _record(_caller(sys._getframe(1)), value, tensor.numel() <= LARGEST_LIST,
                _symbolic(name, tensor))
        return value

    return recorded


class _BooleanIndexRecorded(TorchFunctionMode):
    """Records the length of each `x[mask]` (a boolean mask) of a call, read or written, on
    this thread. `Tensor.__getitem__` cannot be wrapped as the readers are: a Python
    `__getitem__` on the class makes every tensor a sequence to CPython (`torch.tensor` of a
    list of 0-d tensors then fails). This mode is entered only where grad is enabled: the fast
    paths that an active mode turns off (`nn.MultiheadAttention`'s, `nn.TransformerEncoder`'s)
    run without grad only, so a call with grad is eager's own under it too."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in ("__getitem__", "__setitem__"):
            sized = selections.form(name, args, kwargs or {})
            if sized is not None:
                _record(_caller(sys._getframe(1)), sized.length(result), symbolic=True)
        return result


def _record(frame: Any, value: Any, kept: bool = True, symbolic: bool = False) -> None:
    """Keeps `value`, read at `frame`, in this thread's recordings, where `kept` (else the read
    is only counted at its line, so the reads after it keep their counts); `symbolic`: a trace
    may make it each call's (`Reads`)."""
    for recorded, counts in getattr(_state, "recorders", ()):
        site = _site(frame, counts)
        if kept:
            recorded.reads.append((*site, value, symbolic))


def _symbolic(name: str, tensor: torch.Tensor) -> bool:
    """Whether the reader `name` of `tensor` reads integers a trace may leave unknown."""
    return name in _SYMBOLIC_READERS and not tensor.is_floating_point() \
        and not tensor.is_complex() and tensor.dtype != torch.bool


def _length_recorded(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(op)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        """The op's result; its length, where data gave it, kept by this thread's recordings
        (once: `Tensor.unique` calls `torch.unique`, which records nothing of its own)."""
        if getattr(_state, "sizing", False) or not getattr(_state, "recorders", ()):
            return op(*args, **kwargs)
        _state.sizing = True
        try:
            result = op(*args, **kwargs)
        finally:
            _state.sizing = False
        sized = selections.form(name, args, kwargs)
        if sized is not None:
            _record(_caller(sys._getframe(1)), sized.length(result), symbolic=True)
        return result

    return recorded


def _ties_recorded(op: Callable[..., Any], check: Callable[[tuple, dict], torch.Tensor | None]
                   ) -> Callable[..., Any]:
    @functools.wraps(op)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        """The op's result; where this thread records and its picks tie (`check`), the line
        that called it, kept by the recordings (once: the check's own selection, and a method
        reached again from a mode, record nothing)."""
        result = op(*args, **kwargs)
        if not getattr(_state, "recorders", ()) or getattr(_state, "reading", False):
            return result
        _state.reading = True  # (the check's reads of its own tensors are no call's reads)
        try:
            with torch.no_grad():
                held = check(args, kwargs)
                tied = held is not None and not bool(held.all())
        finally:
            _state.reading = False
        if tied:
            frame = _caller(sys._getframe(1))
            for records, _ in _state.recorders:
                records.ties.append((frame.f_code.co_filename, frame.f_lineno))
        return result

    return recorded


_TORCH = os.path.dirname(torch.__file__) + os.sep


def _caller(frame: Any) -> Any:
    """The first frame outside torch's own code and this file's, from `frame` up: the code
    that called an op whose length is recorded or answered. Between it and a torch function
    mode stand torch's Python (`handle_torch_function`; `torch.unique`'s own functions) and the
    trace's other modes (`proxy_tensor`'s, in the joint trace), which eager's call does not
    pass through."""
    while frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__ \
            or frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame


def _site(frame: Any, counts: dict[tuple[str, int], int]) -> tuple[str, int, int]:
    """Where `frame` is (its file and line), and how many times that line was met before."""
    line = (frame.f_code.co_filename, frame.f_lineno)
    count = counts.get(line, 0)
    counts[line] = count + 1
    return (*line, count)


class _Reads:
    """The trace's answers to values read from tensors: the first call's at the same place, each
    kept as a check that the tensor holds it, or each call's (`data_lengths.py`)."""

    def __init__(self, values: Reads, forward_pass: int,
                 fixed: Collection[data_lengths.Line]) -> None:
        self.values = {(file, line, count): value for file, line, count, value, _ in values}
        self._counts: dict[tuple[str, int], int] = {}
        self._pass = forward_pass
        self._fixed = fixed

    def answer(self, frame: Any, tensor: torch.Tensor, name: str,
               read: Callable[[torch.Tensor], Any]) -> Any:
        """What the reader `name` reads from `tensor` at `frame`: the first call's value there,
        with the check that `tensor` holds it; or, for integers a trace may make each call's
        (`_SYMBOLIC_READERS`) at a line not fixed, `read(tensor)`, which the trace does not
        know (bound to its line, with the first call's: `data_lengths.py`); or, where the first
        call read nothing there, `read(tensor)`."""
        site = _site(frame, self._counts)
        if private.below_python_dispatch():
            raise CaptureError(
                "the forward makes a tensor of tensors' values (`torch.tensor` of a list of "
                "tensors computed from data), which a trace cannot check as it reads them; "
                "`torch.stack` of them is traced")
        value = self.values.get(site)
        if value is None:
            return read(tensor)
        if _symbolic(name, tensor) and site[:2] not in self._fixed:
            result = read(tensor)
            data_lengths.bind_read(result, tensor, site[:2], self._pass, value)
            return result
        if tensor.numel():
            torch._is_all_true(_holds(tensor, value))
        return value

    def length(self, frame: Any, sized: selections.Form, op: Callable[[], Any]) -> Any:
        """The result of an op whose length is read from data, called at `frame`: as long as
        the first call's where its line is fixed and the length recorded there (and kept as a
        check), else `op()`, whose length the trace does not know (bound to its line, with the
        first call's: `data_lengths.py`)."""
        site = _site(frame, self._counts)
        length = self.values.get(site)
        if length is not None and site[:2] in self._fixed:
            torch._is_all_true(_holds(sized.count(), length))
            return sized.made(length)
        result = op()
        if result is not None:  # (`x[mask] = v` returns none, and its length is its backward's)
            data_lengths.bind_length(sized.length(result), site[:2], self._pass, length,
                                     _device(result))
        return result


def _device(result: Any) -> torch.device:
    """The device of an op's result (a tensor, or a tuple of them)."""
    return (result[0] if isinstance(result, tuple) else result).device


def _holds(tensor: torch.Tensor, value: Any) -> torch.Tensor:
    """Whether `tensor` holds `value`, read by one of `_READERS` (a `bool` of a number: that
    it is not zero)."""
    if isinstance(value, list):
        return tensor == torch.tensor(value, dtype=tensor.dtype, device=tensor.device)
    if isinstance(value, bool) and tensor.dtype != torch.bool:
        return (tensor != 0) == value
    if isinstance(value, int) and not isinstance(value, bool) and tensor.is_floating_point():
        return tensor.trunc() == value  # `int(x)` of a float
    return tensor == value


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


def _distinct_picks(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Whether a top-k's picks, and the value after them, are all distinct (`torch.topk`'s
    arguments). Among equal values eager's kernel picks in an order of its own (its selection
    algorithm's: `tensor([3., 3., 3., 3.]).topk(3)` gives indices 2, 3, 0 on the CPU), which
    ONNX's TopK does not follow (the lowest index first): the indices, and the positions the
    gradient reaches, would differ silently. A call with a tie runs in eager PyTorch."""
    input = args[0] if args else kwargs["input"]
    if input.dim() == 0:
        return None
    k = args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    compared = torch.sym_min(k + 1, input.shape[dim])
    values = torch.topk(input, compared, dim, largest, True).values
    return values.narrow(dim, 1, compared - 1) != values.narrow(dim, 0, compared - 1)


def _only_median(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Whether a median along a dimension (`torch.median`'s arguments) picks in each row a value
    no other element equals, nor a NaN (eager's median is then the NaN): among equal values the
    index eager returns is its kernel's choice, the trace's the first of a stable sort
    (`lowerings.sorted_pick`). A median of every element, whose gradient is shared among the
    elements equal to it, needs none."""
    input = args[0] if args else kwargs["input"]
    if input.dim() == 0 or (len(args) < 2 and "dim" not in kwargs):
        return None
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    picked = torch.median(input, dim, True).values
    return _only(input, picked, dim) & ~input.isnan().any(dim)


def _only_kth(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`_only_median` for `torch.kthvalue` (NaN sorts last, as in the trace's sort)."""
    input = args[0] if args else kwargs["input"]
    if input.dim() == 0:
        return None
    k = args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return _only(input, torch.kthvalue(input, k, dim, True).values, dim)


def _only(input: torch.Tensor, picked: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether each row of `input` along `dim` holds its picked value once."""
    return (input == picked).sum(dim) == 1


# The selections whose picks among equal values eager's kernels order their own way: the check
# that a call's picks are free of ties.
_PICKS: dict[Any, Callable[[tuple, dict], torch.Tensor | None]] = {
    torch.topk: _distinct_picks, torch.Tensor.topk: _distinct_picks,
    torch.median: _only_median, torch.Tensor.median: _only_median,
    torch.kthvalue: _only_kth, torch.Tensor.kthvalue: _only_kth,
}


# function -> the check of its index arguments (a top-k's, a median's: of its picks), from the
# call's (args, kwargs), or None. Not `index_fill`, `take_along_dim` and indexing (`x[rows]`),
# which take -1 from the end in eager.
_CHECKS: dict[Any, Callable[[tuple, dict], torch.Tensor | None]] = {
    F.embedding: lambda a, k: _in_range(a[0], (a[1] if len(a) > 1 else k["weight"]).shape[0]),
    torch.embedding: lambda a, k: _in_range(a[1], a[0].shape[0]),
    F.one_hot: lambda a, k: None if (n := a[1] if len(a) > 1 else k.get("num_classes", -1)) < 0
    else _in_range(a[0], n),
    F.cross_entropy: lambda a, k: _classes(*a, **k),
    F.nll_loss: lambda a, k: _classes(*a, **k),
    **_PICKS,
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
    `_CHECKS` are kept as checks (`_is_all_true`, which `deferred` keeps), and an op whose
    output length is read from data is made with the first call's length (`selections.py`),
    where it is recorded, with the check that the data gives it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        reads = getattr(_state, "reads", None)
        sized = selections.form(getattr(func, "__name__", ""), args, kwargs) \
            if reads is not None else None
        if sized is not None:
            return reads.length(_caller(sys._getframe(1)), sized, lambda: func(*args, **kwargs))
        check = _CHECKS.get(func)
        if check is not None and getattr(_state, "kept", None) is not None:
            try:
                held = check(args, kwargs)
            except (IndexError, KeyError, AttributeError, TypeError):
                held = None  # arguments in a form not read here: the op itself judges them
            if held is not None:
                torch._is_all_true(held)
        return func(*args, **kwargs)
