"""Symbolic sizes: where each size symbol can be read, and size expressions as code or FX nodes.

The trace gives every dynamic input dimension a symbol (s0, s1, ...); sizes derived from them
(a reshape to `s0 * s1`, `math.sqrt(s2 // 4)`) are sympy expressions. They are kept as Python
source over the symbol names, so that a graph built once can be stored, loaded and evaluated
on the sizes of any later call without sympy on the hot path. sympy (32 MiB resident) is imported
by the functions that build, never at import: a process served from the disk cache, or before its
first build, does not need it.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from lazygrad.capture import private

if TYPE_CHECKING:
    import sympy

aten = torch.ops.aten

# symbol name -> (primal index, dimension) where its value can be read
Locations = dict[str, tuple[int, int]]


def is_symbolic(value: object) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def same_sizes(a: Sequence[object], b: Sequence[object]) -> bool:
    """Two shapes are equal, symbol for symbol (comparing SymInts would add guards)."""
    return [str(size) for size in a] == [str(size) for size in b]


def expression(value: object) -> sympy.Basic:
    """The sympy expression of a SymInt/SymFloat/SymBool (or a plain number)."""
    import sympy

    if is_symbolic(value):
        return value.node.expr  # type: ignore[union-attr]
    return sympy.sympify(value)


def to_code(value: object) -> str:
    """Python source for a size or a condition on sizes, over the symbol names."""
    import sympy

    if isinstance(value, (int, float, bool)):
        return repr(value)
    expr = value if isinstance(value, sympy.Basic) else expression(value)
    return private.PythonPrinter().doprint(expr)


def locations(values: Sequence[object]) -> Locations:
    """Where each symbol appears as a whole dimension of one of `values` (fake tensors)."""
    import sympy

    where: Locations = {}
    for index, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and expr.name not in where:
                    where[expr.name] = (index, dim)
    return where


def hints(values: Sequence[object]) -> dict[str, int]:
    """The example value the trace saw for each symbol that is a whole dimension of `values`
    (fake tensors)."""
    import sympy

    found = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) \
                        and size.node.has_hint():
                    found[size.node.expr.name] = int(size.node.hint)
    return found


def sizes(tensors: Sequence[torch.Tensor], where: Locations) -> dict[str, int]:
    """The value of every symbol for a call with these tensors."""
    return {name: tensors[index].shape[dim] for name, (index, dim) in where.items()}


@functools.lru_cache(maxsize=4096)
def compiled(code: str, names: tuple[str, ...]) -> Callable[..., object]:
    """`code` as a function of the symbols `names` (cached: expressions repeat every call)."""
    return eval(f"lambda {', '.join(names)}: ({code})", {"math": math, "torch": torch})  # noqa: S307


def evaluate(code: str, env: dict[str, int]) -> object:
    return compiled(code, tuple(env))(**env)


def emit(graph: fx.Graph, value: object, where: dict[str, tuple[fx.Node, int]]) -> object:
    """FX nodes that compute the size `value` from `sym_size` of tensor nodes in `where`.

    Every new node carries `meta["val"]`: the exporter's verifier and translator read it.
    """
    if not is_symbolic(value):
        return value
    return _emit(graph, expression(value), where)


# torch's sympy functions of two sizes -> the Python operator that computes them on SymInts
_BINARY = {
    "FloorDiv": operator.floordiv,
    "FloatTrueDiv": operator.truediv,
    "IntTrueDiv": operator.truediv,
    "PythonMod": operator.mod,
    "Mod": operator.mod,
}
# torch's sympy functions of one size -> the function that computes them on a SymFloat/SymInt
_UNARY = {
    "ToFloat": torch.sym_float,
    "TruncToInt": math.trunc,
    "FloorToInt": math.floor,
    "CeilToInt": math.ceil,
}
# of several sizes, folded pairwise
_VARIADIC = {"Max": torch.sym_max, "Min": torch.sym_min}


def _emit(graph: fx.Graph, expr: sympy.Basic, where: dict[str, tuple[fx.Node, int]]) -> object:
    import sympy

    def node(target: Callable, args: tuple, val: object) -> fx.Node:
        made = graph.call_function(target, args)
        made.meta["val"] = val
        return made

    def val(arg: object) -> object:
        return arg.meta["val"] if isinstance(arg, fx.Node) else arg

    if isinstance(expr, sympy.Symbol):
        if expr.name not in where:
            raise NotImplementedError(f"size symbol {expr} is not a dimension of any input")
        tensor, dim = where[expr.name]
        return node(aten.sym_size.int, (tensor, dim), tensor.meta["val"].shape[dim])
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, (sympy.Mul, sympy.Add)):
        op = operator.mul if isinstance(expr, sympy.Mul) else operator.add
        args = [_emit(graph, arg, where) for arg in expr.args]
        acc = args[0]
        for arg in args[1:]:
            acc = node(op, (acc, arg), op(val(acc), val(arg)))
        return acc
    if isinstance(expr, (sympy.Float, sympy.Rational)):
        return float(expr)
    binary = _BINARY.get(type(expr).__name__)
    if binary is not None:
        a, b = (_emit(graph, arg, where) for arg in expr.args)
        return node(binary, (a, b), binary(val(a), val(b)))
    unary = _UNARY.get(type(expr).__name__)
    if unary is not None:
        a = _emit(graph, expr.args[0], where)
        return node(unary, (a,), unary(val(a)))
    variadic = _VARIADIC.get(type(expr).__name__)
    if variadic is not None:
        args = [_emit(graph, arg, where) for arg in expr.args]
        acc = args[0]
        for arg in args[1:]:
            acc = node(variadic, (acc, arg), variadic(val(acc), val(arg)))
        return acc
    if isinstance(expr, sympy.Pow) and isinstance(expr.args[1], sympy.Integer) and expr.args[1] > 1:
        base = _emit(graph, expr.args[0], where)
        acc = base
        for _ in range(int(expr.args[1]) - 1):
            acc = node(operator.mul, (acc, base), val(acc) * val(base))
        return acc
    if isinstance(expr, sympy.Pow) and expr.args[1] == -1:
        a = _emit(graph, expr.args[0], where)
        return node(operator.truediv, (1.0, a), operator.truediv(1.0, val(a)))
    raise NotImplementedError(f"size expression {expr} ({type(expr).__name__})")
