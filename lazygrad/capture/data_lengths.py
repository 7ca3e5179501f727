"""Lengths made as each call's data says, and the checks of what the trace assumed of them.

An op whose result's length is read from data (`selections.py`), or an integer read by `item()`
or `tolist()`, that the trace does not answer with the first call's (`checks.py`) makes a size
the trace does not know, a symbol without a value (unbacked): the graph computes it at every
call (ONNX's NonZero; the tensor read), so one graph serves every length, as token routing gives
each expert another count of tokens at every step.
torch's reasoning on such a size holds for every value it may take, but for two things, which
the graph checks at every call where it can (through the checks result of `checks.py`; a call
where one fails runs again in eager PyTorch):

- a branch of the user's code on the length (`if tokens.shape[0] == 0: continue`), on which a
  trace fails (`GuardOnDataDependentSymNode`): the trace takes the branch the first call's
  length takes, and keeps the check that the call's length takes it too (not a branch inside
  torch's own ops, a loop over a tensor's rows: the exporter traces the graph's ops again);
- a condition torch assumed of it, to assert at run time (a reshape by it that divides,
  `torch._check`), which a graph would not run: kept as a check.

Each is checked where the forward made it and can compute it (the lengths of this run of the
forward, as 0-d tensors of their sizes, and integers: `_tensor`). Where not (one met by the
backward's trace, one of a size no such op made, a length the first call did not record), the
failure names the lines of code (file, line) whose lengths are to be the first call's instead.

AOTAutograd runs the forward twice (a pass for its metadata, then the joint trace): each symbol
is bound to its line and to the pass that made it; an assertion relating two passes' symbols
(its check that an output's size came out the same both times) holds by construction. It then
runs the traced graph once more (`rerun`), whose fresh sizes are rebound to the trace's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from lazygrad.capture import private

if TYPE_CHECKING:  # (sympy is imported where a build needs it: `import lazygrad` stays light)
    import sympy

# (file, line) of code that made a length from data, or read an integer
Line = tuple[str, int]


class _State(threading.local):
    """What the trace running on this thread bound and answered (each thread starts empty)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bound: dict[Any, _Bound] = {}  # symbol -> the length or integer it stands for
        self.passes = 0  # runs of the forward so far
        self.open: int | None = None  # the run going on
        self.checked: set[sympy.Basic] = set()  # conditions assumed that a check holds
        self.shape_env: Any = None  # the trace's, once it bound a symbol
        self.traced: set[sympy.Basic] | None = None  # the conditions assumed by the trace
        # symbol -> it, as a 0-d tensor of the traced graph (while the trace runs: a traced
        # tensor kept after it would be taken for one user code kept, `escapes.py`)
        self.tensors: dict[Any, Callable[[], torch.Tensor]] = {}


_state = _State()


@dataclasses.dataclass(frozen=True)
class _Bound:
    line: Line
    forward_pass: int
    hint: int | None  # the first call's, where it recorded one


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """While a trace runs (on this thread): no symbol is bound yet, and a branch on a length it
    bound is answered (`_answering`). One trace at a time (`trace._lock`)."""
    _state.reset()
    evaluate = private.ShapeEnv.evaluate_expr
    private.ShapeEnv.evaluate_expr = _answering(evaluate)
    try:
        yield
    finally:
        private.ShapeEnv.evaluate_expr = evaluate
        _state.tensors.clear()


@contextlib.contextmanager
def forward_pass() -> Iterator[int]:
    """One run of the forward within the trace; its number."""
    _state.passes += 1
    previous, _state.open = _state.open, _state.passes
    try:
        yield _state.passes
    finally:
        _state.open = previous


def bind_length(length: Any, line: Line, forward_pass: int, hint: int | None,
                device: torch.device) -> None:
    """`length`, an op's result's length made from data at `line`, in `forward_pass`; `hint`:
    the first call's there."""
    _bind(length, line, forward_pass, hint,
          lambda: torch.scalar_tensor(length, dtype=torch.int64, device=device))


def bind_read(values: Any, tensor: torch.Tensor, line: Line, forward_pass: int,
              hints: Any) -> None:
    """`values`, the integers read from `tensor` at `line` (`item()`, `tolist()`: one, or a
    list), in `forward_pass`; `hints`: the first call's there, alike."""
    flat = pytree.tree_leaves(values)
    hinted = pytree.tree_leaves(hints)
    for index, value in enumerate(flat):
        _bind(value, line, forward_pass, hinted[index] if len(hinted) == len(flat) else None,
              lambda index=index: tensor.reshape(-1)[index].to(torch.int64))


def _bind(value: Any, line: Line, forward_pass: int, hint: int | None,
          tensor: Callable[[], torch.Tensor]) -> None:
    if isinstance(value, torch.SymInt):
        symbols = private.free_unbacked_symbols(value)
        if len(symbols) == 1 and value.node.expr in symbols:  # the symbol itself
            _state.bound[value.node.expr] = _Bound(line, forward_pass, hint)
            _state.tensors[value.node.expr] = tensor
            _state.shape_env = value.node.shape_env


def checks_of(forward_pass: int) -> list[torch.Tensor]:
    """At the end of `forward_pass`: a boolean tensor per condition assumed of its lengths (and
    per branch answered, `_answering`), each computed from them."""
    made = []
    if _state.shape_env is not None:
        for asserts in _state.shape_env.deferred_runtime_asserts.values():
            for assertion in asserts:
                if assertion.expr not in _state.checked and _computable(assertion.expr) \
                        and _pass_of(assertion.expr) == forward_pass:
                    made.append(_tensor(assertion.expr))
                    _state.checked.add(assertion.expr)
    return made


def traced(shape_env: Any) -> None:
    """The trace's graph is made: the conditions assumed so far are its; AOTAutograd's run of
    it after (`rerun`) assumes them again, of its own sizes."""
    _state.traced = {assertion.expr for asserts in shape_env.deferred_runtime_asserts.values()
                     for assertion in asserts}


def rerun(graph: Any, shape_env: Any) -> Callable[..., Any]:
    """`graph` as AOTAutograd runs it once more on the trace's inputs, for its outputs: each
    size from data it makes again is told to be the one the trace made (`rebind_unbacked`, as
    torch.export's retracing does), so its ops' own branches on them (`unbind`'s on a length of
    0) go as the trace's went, where a branch the trace answered would fail."""

    class Rebinding(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            result = super().run_node(node)
            made = set(private.free_unbacked_symbols(result))
            if made - set(node.meta.get("unbacked_bindings") or ()):  # (none: memoized)
                private.rebind_unbacked(shape_env, node, result)
            return result

    def run(*args: Any) -> Any:
        return Rebinding(graph).run(*args)

    return run


def lines_branched_on(error: BaseException) -> frozenset[Line]:
    """The lines whose lengths the trace that raised `error` branched on (none if it did not
    fail on a branch on a length from data)."""
    while error is not None and not isinstance(error, private.GuardOnDataDependentSymNode):
        error = error.__cause__ or error.__context__
    if error is None:
        return frozenset()
    return frozenset(bound.line for bound in _bound(error.cond.free_symbols))


def lines_assumed(shape_env: Any) -> tuple[frozenset[Line], bool]:
    """The lines whose lengths the last trace assumed a condition of that no check holds (of
    one pass), and whether it assumed one of a size from data that no such line made (a read
    inside torch's C++, an op not in `selections.py`, a selection in the backward). With such
    a condition, the lines of the conditions checked too: the backward's are most often those
    of the forward again, of its own selection (the reshape's, where `x[mask]` is reshaped),
    which the first call's lengths at those lines take away. Those of AOTAutograd's run of
    the traced graph after the trace (`rerun`) are the trace's again."""
    lines: set[Line] = set()
    checked: set[Line] = set()
    unknown = False
    for asserts in shape_env.deferred_runtime_asserts.values():
        for assertion in asserts:
            symbols = private.free_unbacked_symbols(assertion.expr)
            bound = _bound(symbols)
            if assertion.expr in _state.checked:
                checked.update(b.line for b in bound)
            elif _state.traced is not None and assertion.expr not in _state.traced:
                continue  # the run of the graph after the trace
            elif len(bound) < len(symbols):
                unknown = True
            elif len({b.forward_pass for b in bound}) == 1:
                lines.update(b.line for b in bound)
    return frozenset(lines | checked if unknown else lines), unknown


def lines_named(names: set[str]) -> frozenset[Line]:
    """The lines of the lengths the last trace bound to symbols of these names."""
    return frozenset(bound.line for symbol, bound in _state.bound.items()
                     if str(symbol) in names)


def _answering(evaluate: Any) -> Any:
    @functools.wraps(evaluate)
    def answered(shape_env: Any, expression: Any, *args: Any, **kwargs: Any) -> Any:
        """`ShapeEnv.evaluate_expr`, but a branch on lengths this run of the forward bound,
        each with the first call's value, is answered with theirs, which the shape environment
        is told as a condition to assert at run time (so it reasons on from it: a length
        answered 3 is 3 from then on), which `checks_of` checks."""
        try:
            return evaluate(shape_env, expression, *args, **kwargs)
        except private.GuardOnDataDependentSymNode as error:
            answer = _answer(error.cond) if _asked_by_user_code(sys._getframe(1)) else None
            if answer is None:
                raise
            import sympy

            fact = error.cond if answer is sympy.true else sympy.Not(error.cond) \
                if answer is sympy.false else sympy.Eq(error.cond, answer)
            shape_env.guard_or_defer_runtime_assert(fact, "as the signature's first call")
            return answer

    return answered


# Where torch turns a symbolic size into a Python bool or int: between the code that asked and
# the shape environment
_SYMBOLIC_PLUMBING = tuple(os.path.join(os.path.dirname(torch.__file__), *path) for path in (
    ("__init__.py",), ("fx", "experimental", "sym_node.py"),
    ("fx", "experimental", "symbolic_shapes.py"), ("fx", "experimental", "recording.py")))
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _asked_by_user_code(frame: Any) -> bool:
    """Whether the branch evaluated at `frame` is the user's code's (`if n == 0:`), not one of
    torch's own ops (`unbind`'s on a length of 0): the exporter traces the graph's ops again,
    with sizes of its own, and would meet theirs again, unanswered."""
    while frame is not None and frame.f_code.co_filename in _SYMBOLIC_PLUMBING:
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(_TORCH)


def _answer(expression: sympy.Basic) -> sympy.Basic | None:
    """`expression` with the first call's values of its symbols, where all are lengths this
    run of the forward bound, each with one, and nothing else; else None."""
    import sympy

    if _state.open is None or _pass_of(expression) != _state.open:
        return None
    bound = _bound(expression.free_symbols)
    if len(bound) < len(expression.free_symbols) or any(b.hint is None for b in bound) \
            or not _computable(expression):
        return None
    answer = expression.xreplace({symbol: sympy.Integer(_state.bound[symbol].hint)
                                  for symbol in expression.free_symbols})
    return answer if answer.is_Boolean or answer.is_Integer else None


def _pass_of(expression: sympy.Basic) -> int | None:
    """The forward pass that bound all symbols of `expression` (None: none, or several)."""
    symbols = expression.free_symbols
    bound = _bound(symbols)
    passes = {b.forward_pass for b in bound}
    return passes.pop() if symbols and len(bound) == len(symbols) and len(passes) == 1 else None


def _bound(symbols: Any) -> list[_Bound]:
    return [_state.bound[symbol] for symbol in symbols if symbol in _state.bound]


def _computable(expression: sympy.Basic) -> bool:
    """Whether `_tensor` can compute `expression`: its symbols stand for values bound here, and
    its operations are `_operations`'."""
    if expression.is_Boolean and not expression.args or expression.is_Integer:
        return True
    if expression.is_Symbol:
        return expression in _state.tensors
    return type(expression) in _operations() and all(map(_computable, expression.args))


def _tensor(expression: sympy.Basic) -> torch.Tensor:
    """`expression` computed in the traced graph from the values its symbols stand for (one
    `_computable`)."""
    if expression.is_Boolean and not expression.args:
        return torch.tensor(bool(expression))
    if expression.is_Integer:
        return torch.tensor(int(expression))
    if expression.is_Symbol:
        return _state.tensors[expression]()
    return _operations()[type(expression)](*map(_tensor, expression.args))


@functools.cache
def _operations() -> dict[type, Callable[..., torch.Tensor]]:
    """The operations of sympy expressions of sizes, as torch computes them."""
    import sympy

    functions = private.sympy_functions
    return {
        sympy.Add: lambda *a: functools.reduce(torch.add, a),
        sympy.Mul: lambda *a: functools.reduce(torch.mul, a),
        sympy.Eq: torch.eq, sympy.Ne: torch.ne, sympy.Lt: torch.lt, sympy.Le: torch.le,
        sympy.Gt: torch.gt, sympy.Ge: torch.ge,
        sympy.And: lambda *a: functools.reduce(torch.logical_and, a),
        sympy.Or: lambda *a: functools.reduce(torch.logical_or, a),
        sympy.Not: torch.logical_not,
        sympy.Mod: torch.remainder, functions.Mod: torch.remainder,
        functions.PythonMod: torch.remainder,
        functions.FloorDiv: lambda a, b: torch.div(a, b, rounding_mode="floor"),
        functions.CleanDiv: lambda a, b: torch.div(a, b, rounding_mode="floor"),
        functions.Max: lambda *a: functools.reduce(torch.maximum, a),
        functions.Min: lambda *a: functools.reduce(torch.minimum, a),
    }
