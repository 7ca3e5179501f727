"""Stage 3d: products whose operands broadcast, computed without the broadcast result.

A product of operands that broadcast against each other (`expert_out * weights.unsqueeze(-2)`,
summed over the experts: a dense Mixture-of-Experts layer's mixing; its backward's
`expand(grad.unsqueeze(-1)) * weights`) is as large as the two operands' outer sizes. ONNX
Runtime's CPU Mul and Expand walk such a broadcast one innermost span at a time: a [4, 32, 128,
4] product with the experts innermost is 16,384 spans of 4, 0.33 ms (Mul) and 0.43 ms (Expand)
where eager takes 0.05 ms and 0.04 ms; on the benchmark's MoE layer those nodes were 40% of a
step. Two rewrites of the same values, each where a product broadcasts:

- summed over a dimension both operands have (a contraction): one matmul, batched over the
  dimensions both keep, which never makes the product (`sum(x[..., m, k] * w[..., None, k], -1)`
  is `x @ w[..., :, None]`). The same products, added in a matmul's order (a sum's roundings),
  in float32 on the CPU only (a half product would be rounded before its sum in eager; on CUDA
  a float32 matmul runs in TF32 where the user allows it, and CUDA's broadcasts are fast).
- read only by `select`s along one dimension (`stack`'s backward picks each expert's part):
  each selection is the product of the operands' selections, the same values, and the whole
  product is never made.

An `expand` an operand comes from is read through: the product broadcasts it anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from lazygrad.capture.node_maker import Maker, value_of
from lazygrad.capture.partition import rebuilt
from lazygrad.capture.peephole import known, same_shape, sum_parts

aten = torch.ops.aten


def rewrite(gm: fx.GraphModule) -> int:
    """Rewrite `gm`'s broadcasting products that are summed or selected from, in place; how
    many."""
    fired = 0
    for node in list(gm.graph.nodes):
        rewritten = _REWRITES.get(node.target)
        if rewritten is None:
            continue
        make = Maker(gm.graph, node)
        try:
            fired += rewritten(make, node)
        except Exception:  # sizes the trace cannot answer, shapes this code did not expect:
            make.undo()  # the node stays as it was
    if fired:
        rebuilt(gm)
    return fired


def _operands(product: fx.Node) -> tuple[fx.Node, fx.Node, list[Any], list[Any]] | None:
    """(a, b, a's sizes, b's sizes) of a tensor product that broadcasts, each operand read
    through an `expand` the product's broadcast makes anyway, sizes padded with leading ones
    to the product's rank; None where it is no such product."""
    if product.target is not aten.mul.Tensor or product.kwargs or len(product.args) != 2 \
            or not all(isinstance(arg, fx.Node) for arg in product.args):
        return None
    out = value_of(product)
    if not isinstance(out, torch.Tensor):
        return None
    a, b = product.args
    a = _through_expand(a, b, out.shape)
    b = _through_expand(b, a, out.shape)
    sizes = [_padded(value_of(operand), out.dim()) for operand in (a, b)]
    if any(s is None or not _broadcasts_to(s, out.shape) for s in sizes):
        return None
    if all(_full(s, out.shape, dim) for s in sizes for dim in range(out.dim())):
        return None  # no broadcast: ORT's kernels run it at memory speed
    return a, b, sizes[0], sizes[1]


def _through_expand(operand: fx.Node, other: fx.Node, shape: Any) -> fx.Node:
    """`operand`'s source where it is an `expand` whose sizes the product gets from its
    operands anyway (each dimension has its whole size in the source or in `other`)."""
    if operand.target is not aten.expand.default or not isinstance(operand.args[0], fx.Node):
        return operand
    source = operand.args[0]
    sizes = [_padded(value_of(node), len(shape)) for node in (source, other)]
    if any(s is None for s in sizes):
        return operand
    if all(any(_full(s, shape, dim) for s in sizes) for dim in range(len(shape))):
        return source
    return operand


def _padded(value: Any, rank: int) -> list[Any] | None:
    if not isinstance(value, torch.Tensor) or value.dim() > rank:
        return None
    return [1] * (rank - value.dim()) + list(value.shape)


def _broadcasts_to(sizes: list[Any], shape: Any) -> bool:
    return all(_is_one(size) or known(size == out) for size, out in zip(sizes, shape))


def _full(sizes: list[Any], shape: Any, dim: int) -> bool:
    """Whether the operand has the product's whole size at `dim` (not broadcast there)."""
    return known(sizes[dim] == shape[dim])


def _is_one(size: Any) -> bool:
    """A size that is the number 1; a symbol is not asked (one that `nonzero` counts has no
    value to guard on: asking raises)."""
    return isinstance(size, int) and size == 1


def _as_matmul(make: Maker, total: fx.Node) -> bool:
    """`sum(a * b, dims)` as one matmul where the product broadcasts and `dims` holds one
    dimension both operands have; False, the graph as it was, elsewhere (or it raises)."""
    parts = sum_parts(total)
    if parts is None:
        return False
    product, dims, keep = parts
    if len(product.users) != 1:
        return False
    found = _operands(product)
    if found is None:
        return False
    a, b, a_sizes, b_sizes = found
    out = value_of(product)
    if not all(value_of(node).dtype == torch.float32 for node in (a, b, product)) \
            or out.device.type != "cpu":
        return False
    rank = out.dim()
    contracted = {dim % rank for dim in dims} if dims else set(range(rank))
    roles = _roles(a_sizes, b_sizes, out.shape, contracted)
    if roles is None:
        return False
    made = _matmul(make, total, a, b, roles, rank, contracted, keep)
    if not same_shape(value_of(made), value_of(total)):
        raise ValueError("the matmul's result differs in shape")
    total.replace_all_uses_with(made)
    return True


class _Roles:
    """A contraction's dimensions: `batch` (both operands, kept), `contracted` (both, summed),
    `rows` (the left operand's alone), `columns` (the right's alone), or None; `swapped`:
    the left operand is the product's second."""

    def __init__(self, batch: list[int], contracted: int, rows: int | None,
                 columns: int | None, swapped: bool) -> None:
        self.batch, self.contracted = batch, contracted
        self.rows, self.columns, self.swapped = rows, columns, swapped


def _roles(a_sizes: list[Any], b_sizes: list[Any], shape: Any, summed: set[int]
           ) -> _Roles | None:
    batch, contracted, own = [], [], {0: [], 1: []}
    for dim in range(len(shape)):
        if _is_one(shape[dim]):
            continue  # squeezed from both, put back where the result has it
        full = [_full(sizes, shape, dim) for sizes in (a_sizes, b_sizes)]
        if all(full):
            (contracted if dim in summed else batch).append(dim)
        elif dim in summed:
            return None  # summed in one operand alone: not a single matmul
        else:
            own[0 if full[0] else 1].append(dim)
    if len(contracted) != 1 or len(own[0]) > 1 or len(own[1]) > 1:
        return None
    dims = [*contracted, *own[0], *own[1]]
    if batch and max(batch) > min(dims):
        return None  # a batch dimension after the matrix ones: a transpose, not a view
    rows, columns = (own[0] or [None])[0], (own[1] or [None])[0]
    swapped = rows is not None and columns is not None and columns < rows
    if swapped:
        rows, columns = columns, rows
    return _Roles(batch, contracted[0], rows, columns, swapped)


def _matmul(make: Maker, at: fx.Node, a: fx.Node, b: fx.Node, roles: _Roles, rank: int,
            summed: set[int], keep: bool) -> fx.Node:
    left, right = (b, a) if roles.swapped else (a, b)
    left = _matrix(make, at, left, rank, roles, roles.rows, rows_first=True)
    right = _matrix(make, at, right, rank, roles, roles.columns, rows_first=False)
    result = make(at, aten.matmul.default, left, right)
    if roles.columns is None:
        result = make(at, aten.squeeze.dim, result, -1)
    if roles.rows is None:
        result = make(at, aten.squeeze.dim, result, -1 if roles.columns is None else -2)
    kept = {*roles.batch, *(d for d in (roles.rows, roles.columns) if d is not None)}
    final = [dim for dim in range(rank) if keep or dim not in summed]
    for position, dim in enumerate(final):
        if dim not in kept:
            result = make(at, aten.unsqueeze.default, result, position)
    return result


def _matrix(make: Maker, at: fx.Node, operand: fx.Node, rank: int, roles: _Roles,
            own: int | None, rows_first: bool) -> fx.Node:
    """`operand` as [batch..., rows, contracted] (`rows_first`) or [batch..., contracted,
    columns], by views, and a transpose of its last two dimensions that a matmul reads as
    such."""
    offset = rank - value_of(operand).dim()
    matrix = [dim for dim in (roles.contracted, own) if dim is not None]
    dropped = [dim - offset for dim in range(offset, rank)
               if dim not in roles.batch and dim not in matrix]
    for dim in reversed(dropped):  # squeeze.dims has no ONNX translation
        operand = make(at, aten.squeeze.dim, operand, dim)
    if own is None:
        return make(at, aten.unsqueeze.default, operand, -2 if rows_first else -1)
    in_order = (own < roles.contracted) == rows_first
    return operand if in_order else make(at, aten.transpose.int, operand, -2, -1)


def _as_selected_products(make: Maker, product: fx.Node) -> bool:
    """Each `select(a * b, dim, i)` that reads a broadcasting product, as `select(a, dim, i)
    * select(b, dim, i)` (an operand broadcast there: its only element); where every reader of
    the product is such a select on one dimension, so that the product is never made (or it
    raises)."""
    readers = list(product.users)
    if not readers or any(r.target is not aten.select.int or r.kwargs for r in readers):
        return False
    rank = value_of(product).dim() if isinstance(value_of(product), torch.Tensor) else 0
    dims = {reader.args[1] % rank for reader in readers} if rank else set()
    if len(dims) != 1:
        return False
    found = _operands(product)
    if found is None:
        return False
    (dim,) = dims
    a, b, *_ = found
    replaced = []
    for reader in readers:
        picked = [_picked(make, reader, operand, rank, dim, reader.args[2]) for operand in (a, b)]
        made = make(reader, aten.mul.Tensor, *picked)
        if not same_shape(value_of(made), value_of(reader)):
            raise ValueError("the selected product differs in shape")
        replaced.append((reader, made))
    for reader, made in replaced:
        reader.replace_all_uses_with(made)
    return True


def _picked(make: Maker, at: fx.Node, operand: fx.Node, rank: int, dim: int, index: Any
            ) -> fx.Node:
    """`operand`'s part at `index` of the product's `dim`: its only element where it is
    broadcast there, all of it where it has no such dimension."""
    own = dim - (rank - value_of(operand).dim())
    if own < 0:
        return operand
    if _is_one(value_of(operand).shape[own]):
        return make(at, aten.squeeze.dim, operand, own)  # a Gather in ONNX, as a select
    return make(at, aten.select.int, operand, own, index)


# The op each rewrite starts from.
_REWRITES: dict[Any, Callable[[Maker, fx.Node], bool]] = {
    aten.sum.dim_IntList: _as_matmul,
    aten.mul.Tensor: _as_selected_products,
}
