"""Before to_onnx: complex tensors through ops whose ONNX translation takes real tensors only.

ONNX has no complex type: the exporter holds a complex tensor as a real one with a trailing
dimension of 2 (real, imaginary), and torchlib translates some ops on that representation
(`mul`, `cat`, `permute`, `view`, FFTs), but not `unsqueeze`, `expand`, `where`, a matrix
product and other ops that complex rotary embeddings (Llama 4) and spectral layers (Fourier
neural operators) meet: their graphs did not export, and those modules ran eagerly.

Each such node is written here, in place, as the same op on the real representation: its
complex inputs viewed as real (`view_as_real`), its arguments moved to the trailing dimension
(a negative dimension is one further from the end, a size list gains the 2), and its result
viewed as complex again. The views are identities in ONNX; torch computes the same values
through them, and the check compares ORT with this graph as with any other. A matrix product
of complex tensors is its four real products. Ops torchlib translates for complex tensors, and
those not in `_REWRITES`, are left as they are (the exporter names what it cannot translate).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from lazygrad.capture import private

aten = torch.ops.aten


def as_real_pairs(gm: fx.GraphModule, translated: Callable[[Any], bool]) -> None:
    """Rewrite, in place, each node with complex tensors among its inputs or result whose op
    has no complex translation (`translated(op)` is False) and a rewrite here."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and "val" in node.meta:  # a stashed conjugate, made so
            node.meta["val"] = _physical(node.meta["val"])
        if node.op != "call_function" or node.target not in _REWRITES:
            continue
        if not (_complex_inputs(node) or _is_complex(node)):
            continue
        if node.target not in _ALWAYS and translated(node.target):
            continue
        with gm.graph.inserting_before(node):
            result = _REWRITES[node.target](_Emit(gm.graph), node)
        if result is None:
            continue
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


class _Emit:
    """New nodes before the rewritten one, each with its fake value (the exporter reads them)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        # A factory op reads no fake tensor that would dispatch it to the fake mode (complex
        # zeros of symbolic sizes, made as pairs: the CPU kernel refused the symbols); the
        # Python dispatcher, as in the trace (`trace.py`), for a symbolic padding.
        self.fake_mode = private.detect_fake_mode(
            [node.meta.get("val") for node in graph.nodes if node.op == "placeholder"])

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(op, args, kwargs)
        values = fx.node.map_arg((args, kwargs), lambda arg: _physical(arg.meta["val"]))
        with self.fake_mode or contextlib.nullcontext(), private.enable_python_dispatcher():
            node.meta["val"] = op(*values[0], **values[1])
        return node

    def real(self, value: Any) -> Any:
        """A complex node as its real representation; a list's complex nodes alike."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.real(item) for item in value)
        if isinstance(value, fx.Node) and _is_complex(value):
            return self(aten.view_as_real.default, value)
        return value

    def complex(self, node: fx.Node) -> fx.Node:
        return self(aten.view_as_complex.default, node)


def _physical(value: Any) -> Any:
    """A fake value as the rewritten graph computes it: a conjugate is made in memory
    (`_conjugate`), so the views of one carry no conjugate flag."""
    return value.resolve_conj() if isinstance(value, torch.Tensor) and value.is_conj() else value


def _is_complex(value: Any) -> bool:
    found = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(found, torch.Tensor) and found.is_complex()


def _complex_inputs(node: fx.Node) -> bool:
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda arg: found.append(_is_complex(arg)))
    return any(found)


def _dim(dim: int) -> int:
    """A dimension of the complex tensor, in its real representation."""
    return dim - 1 if dim < 0 else dim


def _same_op(
    adjust: Callable[[fx.Node, list], list]
) -> Callable[[_Emit, fx.Node], fx.Node | None]:
    """The node's op on the real representation, its arguments adjusted by `adjust(node,
    args)`, the result viewed as complex. A real floating-point tensor written into the
    complex result (`copy`'s source, `index_put`'s values) is made a complex one first: its
    imaginary part is 0, where broadcast as it is it would fill both parts."""

    def rewrite(emit: _Emit, node: fx.Node) -> fx.Node | None:
        if not _is_complex(node):  # a complex input, a real result: not a layout op's
            return None
        dtype = node.meta["val"].dtype

        def data(value: Any) -> Any:
            found = value.meta.get("val") if isinstance(value, fx.Node) else None
            if isinstance(found, torch.Tensor) and found.is_floating_point():
                return _pair_of(emit, value, dtype)
            return emit.real(value)

        args = adjust(node, [data(arg) for arg in node.args])
        kwargs = {name: data(value) for name, value in node.kwargs.items()}
        return emit.complex(emit(node.target, *args, **kwargs))

    return rewrite


def _dim_at(position: int) -> Callable[[fx.Node, list], list]:
    def adjust(node: fx.Node, args: list) -> list:
        args[position] = _dim(args[position])
        return args

    return adjust


def _dims_at(position: int) -> Callable[[fx.Node, list], list]:
    def adjust(node: fx.Node, args: list) -> list:
        args[position] = [_dim(dim) for dim in args[position]]
        return args

    return adjust


def _sizes_at(position: int, trailing: int) -> Callable[[fx.Node, list], list]:
    def adjust(node: fx.Node, args: list) -> list:
        args[position] = [*args[position], trailing]
        return args

    return adjust


def _unchanged(node: fx.Node, args: list) -> list:
    return args


def _squeeze_all(emit: _Emit, node: fx.Node) -> fx.Node | None:
    shape = node.args[0].meta["val"].shape
    if not all(isinstance(size, int) for size in shape):
        return None
    dims = [dim for dim, size in enumerate(shape) if size == 1]
    return emit.complex(emit(aten.squeeze.dims, emit.real(node.args[0]), dims))


def _padded(emit: _Emit, node: fx.Node) -> fx.Node | None:
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if value != 0:
        return None
    source, pad = node.args[:2]
    return emit.complex(emit(aten.constant_pad_nd.default, emit.real(source), [0, 0, *pad]))


def _gathered(emit: _Emit, node: fx.Node) -> fx.Node:
    source, dim, index = node.args[:3]
    shape = index.meta["val"].shape
    pairs = emit(aten.expand.default, emit(aten.unsqueeze.default, index, -1), [*shape, 2])
    return emit.complex(emit(aten.gather.default, emit.real(source), _dim(dim), pairs))


def _where(emit: _Emit, node: fx.Node) -> fx.Node:
    condition, *choices = node.args
    dtype = node.meta["val"].dtype
    pairs = [_pair_of(emit, choice, dtype) for choice in choices]
    return emit.complex(emit(aten.where.self, emit(aten.unsqueeze.default, condition, -1),
                             *pairs))


def _pair_of(emit: _Emit, value: Any, dtype: torch.dtype) -> Any:
    """`value` as a complex tensor of `dtype` in the real representation."""
    if _is_complex(value):
        return emit.real(value)
    real = dtype.to_real()
    if isinstance(value, fx.Node):  # a real tensor: its imaginary part is 0
        value = emit(aten._to_copy.default, value, dtype=real)
        return emit(aten.stack.default, [value, emit(aten.zeros_like.default, value)], -1)
    number = complex(value)
    return emit(aten.stack.default, [emit(aten.scalar_tensor.default, part, dtype=real)
                                     for part in (number.real, number.imag)])


def _scaled(emit: _Emit, node: fx.Node) -> fx.Node | None:
    """A complex tensor times or over a real one (or a real number): each part scaled; times
    a complex number: its parts' products."""
    left, right = node.args[:2]
    if _is_complex(left) == _is_complex(right):
        return None
    if _is_complex(right):
        if node.target in (aten.div.Tensor, aten.div.Scalar):
            return None
        left, right = right, left
    if isinstance(right, complex):
        if node.target not in (aten.mul.Tensor, aten.mul.Scalar):
            return None
        return _times(emit, _parts(emit, left), (right.real, right.imag), aten.mul.Tensor)
    if isinstance(right, fx.Node):
        right = emit(aten.unsqueeze.default, right, -1)
    target = aten.mul.Tensor if node.target in (aten.mul.Tensor, aten.mul.Scalar) \
        else aten.div.Tensor
    return emit.complex(emit(target, emit.real(left), right))


def _product(matmul: Any) -> Callable[[_Emit, fx.Node], fx.Node | None]:
    """A matrix product of complex tensors: four real matrix products."""

    def rewrite(emit: _Emit, node: fx.Node) -> fx.Node | None:
        left, right = node.args[:2]
        if not (_is_complex(left) and _is_complex(right)):
            return None
        return _times(emit, _parts(emit, left), _parts(emit, right), matmul)

    return rewrite


def _times(emit: _Emit, left: Sequence[Any], right: Sequence[Any], multiply: Any) -> fx.Node:
    """(a + bi)(c + di) = (ac - bd) + (ad + bc)i, from the parts of each side (nodes, or a
    number's), each product made by `multiply`."""
    (a, b), (c, d) = left, right
    real = emit(aten.sub.Tensor, emit(multiply, a, c), emit(multiply, b, d))
    imaginary = emit(aten.add.Tensor, emit(multiply, a, d), emit(multiply, b, c))
    return emit.complex(emit(aten.stack.default, [real, imaginary], -1))


def _conjugate(emit: _Emit, node: fx.Node) -> fx.Node:
    """The conjugate made in memory: torch's is a view with a flag, which `view_as_real`
    refuses to read."""
    real, imaginary = _parts(emit, node.args[0])
    return emit.complex(emit(aten.stack.default, [real, emit(aten.neg.default, imaginary)], -1))


def _zeros(size_at: int) -> Callable[[_Emit, fx.Node], fx.Node | None]:
    """A complex tensor of zeros (`new_zeros`, `zeros`, `full` of 0), made as its pairs."""

    def rewrite(emit: _Emit, node: fx.Node) -> fx.Node | None:
        if node.target in (aten.full.default, aten.new_full.default) \
                and node.args[size_at + 1] != 0:
            return None
        args = [emit.real(arg) for arg in node.args]
        args[size_at] = [*args[size_at], 2]
        kwargs = {**node.kwargs, "dtype": node.meta["val"].dtype.to_real()}
        return emit.complex(emit(node.target, *args, **kwargs))

    return rewrite


def _zeros_like(emit: _Emit, node: fx.Node) -> fx.Node | None:
    """`zeros_like`, `empty_like`, `full_like` of 0 of a complex tensor, made as its pairs."""
    if not _is_complex(node.args[0]) or (
            node.target is aten.full_like.default and node.args[1] != 0):
        return None
    kwargs = {**node.kwargs, "dtype": node.meta["val"].dtype.to_real()}
    return emit.complex(emit(node.target, emit.real(node.args[0]), *node.args[1:], **kwargs))


def _empty_strided(emit: _Emit, node: fx.Node) -> fx.Node:
    source, size, stride = node.args[:3]
    kwargs = {**node.kwargs, "dtype": node.meta["val"].dtype.to_real()}
    doubled = [emit(operator.mul, step, 2) if isinstance(step, fx.Node) else 2 * step
               for step in stride]  # a symbolic stride is a node computing it
    return emit.complex(emit(aten.new_empty_strided.default, emit.real(source), [*size, 2],
                             [*doubled, 1], **kwargs))


def _equal(emit: _Emit, node: fx.Node) -> fx.Node:
    """Complex numbers are equal where both parts are (`ne`: where either differs)."""
    left, right = node.args[:2]
    dtype = (left if _is_complex(left) else right).meta["val"].dtype
    pairs = emit(aten.eq.Tensor, _pair_of(emit, left, dtype), _pair_of(emit, right, dtype))
    equal = emit(aten.all.dim, pairs, -1)
    return equal if node.target in (aten.eq.Tensor, aten.eq.Scalar) \
        else emit(aten.logical_not.default, equal)


def _size(emit: _Emit, node: fx.Node) -> fx.Node:
    """A complex tensor's size where it is a symbol (an FFT over a length that changes), read
    from its real representation."""
    source, dim = node.args
    return emit(aten.sym_size.int, emit.real(source), _dim(dim))


def _parts(emit: _Emit, node: fx.Node) -> Sequence[fx.Node]:
    pairs = emit.real(node)
    return [emit(aten.select.int, pairs, -1, part) for part in (0, 1)]


# Rewritten even where translated: torchlib's complex `mul` and `div` take two complex tensors
# (here a complex and a real operand), its conjugate is made in memory where torch's is a view.
_ALWAYS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten._conj.default}

_REWRITES: dict[Any, Callable[[_Emit, fx.Node], fx.Node | None]] = {
    aten.unsqueeze.default: _same_op(_dim_at(1)),
    aten.squeeze.dims: _same_op(_dims_at(1)),
    aten.squeeze.default: _squeeze_all,
    aten.select.int: _same_op(_dim_at(1)),
    aten.slice_scatter.default: _same_op(_dim_at(2)),
    aten.select_scatter.default: _same_op(_dim_at(2)),
    aten.expand.default: _same_op(_sizes_at(1, 2)),
    aten.reshape.default: _same_op(_sizes_at(1, 2)),
    aten.repeat.default: _same_op(_sizes_at(1, 1)),
    aten.alias.default: _same_op(_unchanged),
    aten.index.Tensor: _same_op(_unchanged),
    aten.index_put.default: _same_op(_unchanged),
    aten.copy.default: _same_op(_unchanged),
    aten.constant_pad_nd.default: _padded,
    aten.gather.default: _gathered,
    aten.where.self: _where,
    aten.mul.Tensor: _scaled,
    aten.mul.Scalar: _scaled,
    aten.div.Tensor: _scaled,
    aten.div.Scalar: _scaled,
    aten._conj.default: _conjugate,
    aten.new_zeros.default: _zeros(1),
    aten.new_empty.default: _zeros(1),
    aten.new_full.default: _zeros(1),
    aten.new_empty_strided.default: _empty_strided,
    aten.zeros_like.default: _zeros_like,
    aten.empty_like.default: _zeros_like,
    aten.full_like.default: _zeros_like,
    aten.zeros.default: _zeros(0),
    aten.empty.memory_format: _zeros(0),
    aten.full.default: _zeros(0),
    aten.eq.Tensor: _equal,
    aten.eq.Scalar: _equal,
    aten.sym_size.int: _size,
    aten.ne.Tensor: _equal,
    aten.ne.Scalar: _equal,
    aten.bmm.default: _product(aten.bmm.default),
    aten.mm.default: _product(aten.mm.default),
}
