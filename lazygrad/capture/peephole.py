"""Stage 3b, peephole: op patterns rewritten into the same values in fewer passes over memory.

PyTorch's decompositions (torch._decomp, which the trace applies) are written for a compiler
that fuses elementwise ops; ONNX Runtime's CPU provider runs each ONNX node as one pass that
allocates its result. The backward of cross-entropy over a vocabulary (`nll_loss_backward`
then `_log_softmax_backward_data`) decomposes into seven passes over the logits: zeros, a
scatter of -1 at the targets, a multiply by each row's weight, exp, a row sum, a multiply and a
subtraction; eager runs it in two. Here it becomes three (softmax, multiply, a scatter-add at
the targets), through rules that each state an identity on values, not on derivatives:

- `mul(scatter(zeros, d, index, v), w)`, `w` one value per row along `d`, is
  `scatter(zeros, d, index, v * w)`: the zeros stay zeros (as in eager's `nll_loss_backward`,
  which writes the targets only);
- `sum(scatter(zeros, d, index, src), d, keepdim)`, one index per row, is `src`: a row holds one
  value and zeros, and adding zeros is exact;
- `scatter(zeros, d, index, src) - a * b`, `b` broadcast along some dimension, is
  `scatter_add(a * -b, d, index, src)`: `0 - x` is `-x` and `s - x` is `-x + s` exactly, and
  `-(a * b)` is `a * -b` exactly.

- `exp(_log_softmax(x, d))` is `_softmax(x, d)` (`softmax_for_exp`), the one rule not exact
  to the bit: the backward reads the probabilities as the exponent of the log-softmax (which
  the partition computes again from the kept logits), two passes, and ORT's CPU Exp kernel
  runs on one thread (7.7 ms over the BERT-shaped benchmark's 1024 x 8000 logits; its
  LogSoftmax, on both, 4.9 ms). The Softmax kernel gives the same value in one multithreaded
  pass, within an ulp or two (exp(x - m) / s rounds otherwise than exp(x - m - log s)), as
  ORT's kernels are of eager's anyway: the exactness tests, 50 training steps among them, hold.

- `pow(x, e)` for e in 1, 2, 3, 0.5, -0.5, -1 and -2 is computed as torch computes it, by `x`
  itself, `x * x`, `x * x * x`, `sqrt`, `rsqrt`, `reciprocal` and `reciprocal(x * x)` (ATen's
  special cases): ORT's Pow runs 1, 0.5, -0.5, -1 and -2 through `std::pow`, 5 ns an element
  on one thread (177 us over [4, 64, 128] against 9 us for the value itself), and 2 and 3 as
  products, but on one thread (4x a Mul). Every RMSNorm has `x.pow(2)`, and its backward
  `pow(x, 2)`'s derivative `2 * x.pow(1)`. The same bits as eager's, except the square root:
  ORT's Sqrt, like its Pow, is one ulp from torch's on about a sixth of the elements (10 times
  faster).

A rule fires only where the shapes prove its condition (symbolic sizes compared from what the
trace knows, adding no assumption). The results of the other rules equal the FX graph's up to
the sign of a zero, and the check (verify.py) runs the rewritten graphs against eager's values
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from lazygrad.capture import private
from lazygrad.capture.partition import rebuilt
from lazygrad.capture.tidy import unaliased

aten = torch.ops.aten

ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


def rewrite(gm: fx.GraphModule) -> int:
    """Apply the rules to `gm` in place, in one pass in graph order; how many fired."""
    fired = 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node.op != "call_function":
            continue  # erased by an earlier rule
        for rule in RULES:
            if rule(gm.graph, node):
                fired += 1
                break
    if fired:
        rebuilt(gm)
    return fired


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def known(condition: Any) -> bool:
    """A condition on sizes known true from what the trace knows (two symbols the trace found
    equal, such as the batch of the inputs and of the labels), never by adding an assumption."""
    return bool(private.statically_known_true(condition))


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(known(x == y) for x, y in zip(a.shape, b.shape))


def sum_parts(total: fx.Node) -> tuple[fx.Node, list[int] | None, bool] | None:
    """(source, dims, keepdim) of a node `sum(source, dims[, keepdim])` of positional
    arguments; None for any other form."""
    if total.target is not aten.sum.dim_IntList or total.kwargs \
            or len(total.args) not in (2, 3) or not isinstance(total.args[0], fx.Node):
        return None
    return total.args[0], total.args[1], len(total.args) == 3 and bool(total.args[2])


def _one_per_row(node: Any, value_kind: str) -> tuple[fx.Node, int, fx.Node, Any] | None:
    """(zeros, dim, index, value or src) if `node` is `scatter(zeros, dim, index, x)` writing
    exactly one element per row along `dim` (`value_kind`: "value" or "src")."""
    target = aten.scatter.value if value_kind == "value" else aten.scatter.src
    if not isinstance(node, fx.Node) or node.target is not target or node.kwargs:
        return None
    zeros, dim, index, value = node.args
    if not isinstance(zeros, fx.Node) or zeros.target not in ZEROS:
        return None
    out, idx = _val(node), _val(index)
    if out is None or idx is None or idx.dim() != out.dim():
        return None
    dim = dim % out.dim()
    if idx.shape[dim] != 1 or not all(
        known(idx.shape[k] == out.shape[k]) for k in range(out.dim()) if k != dim
    ):
        return None
    if value_kind == "src" and not (_val(value) is not None and same_shape(_val(value), idx)):
        return None
    return zeros, dim, index, value


def _call(graph: fx.Graph, before: fx.Node, target: Any, args: tuple, like: Any) -> fx.Node:
    """A new node before `before`, whose value has the shape and dtype of `like`'s."""
    with graph.inserting_before(before):
        made = graph.call_function(target, args)
    made.meta["val"] = _val(like)
    if "custom" in before.meta:
        made.meta["custom"] = before.meta["custom"]
    return made


def _scale_scattered_value(graph: fx.Graph, node: fx.Node) -> bool:
    """mul(scatter(zeros, d, index, v), w) -> scatter(zeros, d, index, w * v)."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    for scattered, weight in (node.args, reversed(node.args)):
        found = _one_per_row(scattered, "value")
        if found is None or len(scattered.users) != 1 or not isinstance(weight, fx.Node):
            continue
        zeros, dim, index, value = found
        w, out = _val(weight), _val(node)
        if w is None or w.dtype != out.dtype or not same_shape(w, _val(index)) \
                or not same_shape(out, _val(scattered)):
            continue
        src = _call(graph, node, aten.mul.Tensor, (weight, value), weight)
        made = _call(graph, node, aten.scatter.src, (zeros, dim, index, src), node)
        node.replace_all_uses_with(made)
        graph.erase_node(node)
        return True
    return False


def _sum_of_one_per_row(graph: fx.Graph, node: fx.Node) -> bool:
    """sum(scatter(zeros, d, index, src), [d], keepdim=True) -> src."""
    if node.target is not aten.sum.dim_IntList or node.kwargs or len(node.args) != 3:
        return False
    scattered, dims, keepdim = node.args
    found = _one_per_row(scattered, "src")
    if found is None or not keepdim or len(dims) != 1:
        return False
    _, dim, _, src = found
    out = _val(node)
    if dims[0] % out.dim() != dim or out.dtype != _val(src).dtype \
            or not same_shape(out, _val(src)):
        return False
    node.replace_all_uses_with(src)
    graph.erase_node(node)
    return True


def _subtract_from_one_per_row(graph: fx.Graph, node: fx.Node) -> bool:
    """scatter(zeros, d, index, src) - a * b (b broadcast) -> scatter_add(a * -b, d, index, src)."""
    if node.target is not aten.sub.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    scattered, product = node.args
    found = _one_per_row(scattered, "src")
    if found is None or not isinstance(product, fx.Node) or product.target is not aten.mul.Tensor \
            or len(product.users) != 1 or product.kwargs:
        return False
    _, dim, index, src = found
    out = _val(node)
    if not (same_shape(out, _val(product)) and same_shape(out, _val(scattered))):
        return False
    for full, broadcast in (product.args, reversed(product.args)):
        small = _val(broadcast)
        if isinstance(full, fx.Node) and small is not None and small.dtype == out.dtype \
                and same_shape(_val(full), out) \
                and small.dim() <= out.dim() and not same_shape(small, out):
            negated = _call(graph, node, aten.neg.default, (broadcast,), broadcast)
            scaled = _call(graph, node, aten.mul.Tensor, (full, negated), node)
            made = _call(graph, node, aten.scatter_add.default, (scaled, dim, index, src), node)
            node.replace_all_uses_with(made)
            graph.erase_node(node)
            return True
    return False


def softmax_for_exp(graph: fx.Graph, node: fx.Node) -> bool:
    """exp(_log_softmax(x, d, False)) -> _softmax(x, d, False), through the `detach`es
    AOTAutograd puts between a value and the backward's read of it."""
    if node.target is not aten.exp.default or len(node.args) != 1 or node.kwargs:
        return False
    log_softmax = unaliased(node.args[0])
    if not isinstance(log_softmax, fx.Node) or log_softmax.target is not aten._log_softmax.default \
            or len(log_softmax.args) != 3 or log_softmax.args[2]:
        return False
    made = _call(graph, node, aten._softmax.default, tuple(log_softmax.args), node)
    node.replace_all_uses_with(made)
    graph.erase_node(node)
    return True


# Exponents ATen computes by other ops than `pow` (its CPU and CUDA kernels' special cases),
# each as its op; `x` alone for 1 (a copy in ATen, ORT drops the Identity).
_POWERS: dict[float, Callable[[fx.Graph, fx.Node, fx.Node], fx.Node]] = {
    1.0: lambda graph, node, x: _call(graph, node, aten.clone.default, (x,), node),
    2.0: lambda graph, node, x: _call(graph, node, aten.mul.Tensor, (x, x), node),
    3.0: lambda graph, node, x: _call(graph, node, aten.mul.Tensor, (
        _call(graph, node, aten.mul.Tensor, (x, x), node), x), node),
    0.5: lambda graph, node, x: _call(graph, node, aten.sqrt.default, (x,), node),
    -0.5: lambda graph, node, x: _call(graph, node, aten.rsqrt.default, (x,), node),
    -1.0: lambda graph, node, x: _call(graph, node, aten.reciprocal.default, (x,), node),
    -2.0: lambda graph, node, x: _call(graph, node, aten.reciprocal.default, (
        _call(graph, node, aten.mul.Tensor, (x, x), node),), node),
}


def powers_as_aten_computes(graph: fx.Graph, node: fx.Node) -> bool:
    """pow(x, e) -> the op ATen computes it with, for the exponents of `_POWERS`, on float32
    and float64 tensors."""
    if node.target is not aten.pow.Tensor_Scalar or len(node.args) != 2 or node.kwargs:
        return False
    x, exponent = node.args
    if not isinstance(x, fx.Node) or isinstance(exponent, bool) \
            or not isinstance(exponent, (int, float)) or float(exponent) not in _POWERS:
        return False
    value, out = _val(x), _val(node)
    if value is None or out is None or value.dtype not in (torch.float32, torch.float64) \
            or out.dtype != value.dtype:
        return False
    made = _POWERS[float(exponent)](graph, node, x)
    node.replace_all_uses_with(made)
    graph.erase_node(node)
    return True


RULES: list[Callable[[fx.Graph, fx.Node], bool]] = [
    _scale_scattered_value,
    _sum_of_one_per_row,
    _subtract_from_one_per_row,
    softmax_for_exp,
    powers_as_aten_computes,
]
