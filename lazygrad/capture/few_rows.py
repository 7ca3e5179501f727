"""Stage 3e: rows summed into a few rows, or one, as one matrix product.

An accumulating index_put over the leading dimension (the backward of `weight[ids]`, of an
embedding) is `scatter_add(base, 0, expand(ids.view(-1, 1, ...)), src)` after
`lowerings.accumulate_rows`, which ONNX Runtime runs as ScatterElements: one element at a time,
in order, each with its own index, read from an int64 tensor as large as `src` (the Expand).
Where the destination has few rows and each row is large, that is most of a step: a
Mixture-of-Experts layer that gathers each token's expert weights (transformers' `batched_mm`
experts) sums [512, 512, 128] into 8 experts' gradients, and its steps took 3.8x eager's, 80% of
it in those ScatterElements and Expands. With few rows the same sums are a product:
`one_hot(ids).T @ src`, each source row times one and the others times zero, the same terms
added in another order (the roundings of a product's sums), at a GEMM's speed.

A sum over the leading dimensions (every bias's and normalization weight's gradient,
`sum(grad, [0])`) is all rows summed into one: `ones(1, N) @ src`, no zero in it, so no guard.
ORT's ReduceSum over leading axes took 2-2.6x a MatMul by ones (34 against 17 us over [1024,
256], 2.3 against 0.9 ms over [8192, 768]; torch's sum 15 us and 0.9 ms), and was further from
the float64 sum than the product (9e-4 against 4e-4 at [8192, 768]).

CPU graphs only: on CUDA a float32 matmul runs in TF32 where the user allows it (session.py),
which would round each term of these sums, and CUDA's ScatterElements and ReduceSum are not
ORT's CPU kernels.

Except where a value is not finite: a zero times an infinity is NaN, so the product would put
NaN in rows the value does not belong to, where eager has its own values. So where the
product's sum is not finite (an infinity or NaN in `src`, or a sum that overflowed), nothing of
it is kept and every row is scattered as before (the rows picked by `nonzero` are all or none,
a count the graph computes each call): that call's result is eager's. Elsewhere the picked rows
are none, and the scatter adds nothing.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from lazygrad.capture.node_maker import Maker, value_of
from lazygrad.capture.partition import rebuilt
from lazygrad.capture.peephole import same_shape, sum_parts

aten = torch.ops.aten
prims = torch.ops.prims

# Elements of a sum over leading dimensions below which it stays a ReduceSum (as fast there).
ONE_ROW_FROM = 1 << 14
# Destination rows, at most: the product does one multiply-add per source element and
# destination row, the scatter one slow indexed add per source element (ScatterElements on the
# CPU, about 12 ns an element against a GEMM's tenths of a nanosecond a multiply-add).
ROWS_AT_MOST = 64
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def rewrite(gm: fx.GraphModule) -> int:
    """Turn each sum of rows into few rows (or one) of `gm` into a product, in place; how
    many."""
    fired = 0
    for node in list(gm.graph.nodes):
        if node.graph is gm.graph and node.target is aten.scatter_add.default:
            matched = _match(node)
            if matched is not None and _as_product(gm.graph, node, *matched):
                fired += 1
        elif node.target is aten.sum.dim_IntList:
            fired += _one_row(gm.graph, node)
    if fired:
        rebuilt(gm)
    return fired


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(base, ids, src) of `scatter_add(base, 0, expand(ids.view(-1, 1, ...)), src)` into at
    most `ROWS_AT_MOST` rows of floats, of sizes known (a weight's), `src` and the index of
    the same shape."""
    if node.kwargs or len(node.args) != 4:
        return None
    base, dim, index, src = node.args
    if dim != 0 or not all(isinstance(a, fx.Node) for a in (base, index, src)) \
            or index.target is not aten.expand.default:
        return None
    column = index.args[0]
    if not isinstance(column, fx.Node) or column.target not in _VIEWS \
            or not isinstance(column.args[0], fx.Node):
        return None
    ids = column.args[0]
    base_val, index_val, src_val = value_of(base), value_of(index), value_of(src)
    ids_val, column_val = value_of(ids), value_of(column)
    if any(v is None for v in (base_val, index_val, src_val, ids_val, column_val)) \
            or src_val.device.type != "cpu":
        return None
    if not base_val.dim() or not all(isinstance(size, int) for size in base_val.shape) \
            or base_val.shape[0] > ROWS_AT_MOST or ids_val.dim() != 1 \
            or not src_val.dtype.is_floating_point or src_val.dtype != base_val.dtype \
            or any(size != 1 for size in column_val.shape[1:]) \
            or not same_shape(index_val, src_val) \
            or not same_shape(base_val[0], src_val[0]):
        return None
    return base, ids, src


def _as_product(graph: fx.Graph, node: fx.Node, base: fx.Node, ids: fx.Node, src: fx.Node
                ) -> bool:
    """Replace `node` by the product and the guarded scatter; False, and the graph as it was,
    where a new node fails on the graph's fake tensors."""
    make = Maker(graph, src)
    if not make.counts_sizes:
        return False  # no symbols here to count the picked rows with
    try:
        made = _product(make, node, base, ids, src)
    except Exception:  # an op on these shapes this code did not expect: the scatter stays
        make.undo()
        return False
    node.replace_all_uses_with(made)
    graph.erase_node(node)
    return True


def _product(make: Maker, node: fx.Node, base: fx.Node, ids: fx.Node, src: fx.Node) -> fx.Node:
    """`base + where(finite, one_hot(ids).T @ src, 0)`, then the rows picked (all where the
    product is not finite, else none) scattered onto it, in `base`'s shape."""
    rows, *row_shape = value_of(base).shape
    width = math.prod(row_shape)
    count = make.size(node, src, 0)
    flat_src = make(node, aten.reshape.default, src, [count, width])
    one_hot = make(node, aten.eq.Tensor, make(node, aten.unsqueeze.default, ids, 1),
                   make(node, aten.arange.start, 0, rows, dtype=value_of(ids).dtype,
                        device=value_of(ids).device))
    weights = make(node, prims.convert_element_type.default, one_hot, value_of(src).dtype)
    product = make(node, aten.mm.default, make(node, aten.t.default, weights), flat_src)
    finite = make(node, aten.isfinite.default, make(node, aten.sum.default, product))
    zero = make(node, aten.scalar_tensor.default, 0, dtype=value_of(src).dtype,
                device=value_of(src).device)
    kept = make(node, aten.where.self, finite, product, zero)
    flat_base = make(node, aten.reshape.default, base, [rows, width])
    summed = make(node, aten.add.Tensor, flat_base, kept)
    every_row = make(node, aten.expand.default, make(node, aten.logical_not.default, finite),
                     [count])
    picked = make.nonzero(node, every_row)
    picked_src = make(node, aten.index_select.default, flat_src, 0, picked)
    picked_ids = make(node, aten.index_select.default, ids, 0, picked)
    picked_index = make(node, aten.expand.default,
                        make(node, aten.unsqueeze.default, picked_ids, 1),
                        [-1, width])
    scattered = make(node, aten.scatter_add.default, summed, 0, picked_index, picked_src)
    return make(node, aten.view.default, scattered, [rows, *row_shape])


def _one_row(graph: fx.Graph, total: fx.Node) -> bool:
    """`sum(src, [0, ..., k - 1], keepdim)` of float32 on the CPU, the other sizes numbers, as
    `ones(1, N) @ src.reshape(N, -1)` in the sum's shape; False, the graph as it was, elsewhere
    (and below `ONE_ROW_FROM` elements at the trace's example sizes)."""
    parts = sum_parts(total)
    if parts is None:
        return False
    src, dims, _ = parts
    value = value_of(src)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 \
            or value.device.type != "cpu" or not dims:
        return False
    rank = value.dim()
    leading = sorted(dim % rank for dim in dims)
    row_shape = list(value.shape[len(leading):])
    if leading != list(range(len(leading))) or not row_shape \
            or not all(isinstance(size, int) for size in row_shape):
        return False
    elements = _example_elements(value)
    if elements is not None and elements < ONE_ROW_FROM:
        return False
    make = Maker(graph, src)
    try:
        # A matrix already (a linear layer's output gradient): no Reshape of the same shape.
        rows = src if rank == 2 else make(
            total, aten.reshape.default, src, [-1, math.prod(row_shape)])
        ones = make(total, aten.new_ones.default, rows, [1, make.size(total, rows, 0)])
        summed = make(total, aten.mm.default, ones, rows)
        made = summed if same_shape(value_of(summed), value_of(total)) else make(
            total, aten.view.default, summed, list(value_of(total).shape))
    except Exception:  # an op on these shapes this code did not expect: the sum stays
        make.undo()
        return False
    total.replace_all_uses_with(made)
    return True


def _example_elements(value: torch.Tensor) -> int | None:
    """`value`'s number of elements at the trace's example sizes; None where a size has no
    example (a count the graph computes)."""
    elements = 1
    for size in value.shape:
        if isinstance(size, torch.SymInt):
            if not size.node.has_hint():
                return None
            size = int(size.node.hint)
        elements *= size
    return elements
