"""ONNX translations of grouped matrix multiplication, the matmul of Mixture-of-Experts layers.

An MoE layer sorts its (token, expert) rows by expert and multiplies each expert's run of rows
by that expert's weight: one grouped matmul, whose group boundaries (`offs`, the running row
count per expert) are tensor values. Under tracing, transformers 5 calls its custom op
`transformers::grouped_mm_fallback` (its backward is the custom op
`transformers::grouped_mm_fallback_backward`), and `aten._grouped_mm` appears for bfloat16;
the exporter has no translation for the first two and torchlib's `_grouped_mm` refuses
offsets. Without them the experts run eagerly (a graph break).

Each group's rows cannot be a slice of the traced graph (their bounds are data: the trace would
refuse the unbacked sizes), but they can be a slice inside ONNX, whose Slice takes its bounds
as tensors. So the translation unrolls over the groups, whose *number* is static (the weight's
leading size, or the offsets' length), while every group's row count stays dynamic: per group,
Slice its rows, MatMul by its weight, and Concat. A group with no rows gives no rows, and a
zero weight-gradient block (a MatMul over an empty inner dimension is zeros).

These compute the ops as their own definitions do; the backward translated here is the
registered implementation of `grouped_mm_fallback_backward` (grad_input[rows of g] =
grad_out[rows of g] @ W_g^T, grad_weight[g] = input[rows of g]^T @ grad_out[rows of g]), not a
gradient formula of ours. Every graph built with them is checked against its FX graph in torch
before it serves a step (verify.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import torch
from onnxscript import opset18 as op

aten = torch.ops.aten

def register(registry: Any, registered: set[str]) -> None:
    """Add the translations that `registry` lacks and whose ops exist now to `registry`.

    `aten._grouped_mm` always (torchlib's own translation is kept for the forms without
    offsets); a library's op once the library has defined it (transformers defines its ops at
    import, possibly after the registry was made). `registered` holds the names done already.
    """
    if "aten::_grouped_mm" not in registered:
        torchlib = registry.get_decomps(aten._grouped_mm.default)
        translation = _aten_grouped_mm(torchlib[0].onnx_function if torchlib else None)
        registry.register_op(aten._grouped_mm.default, translation)
        registered.add("aten::_grouped_mm")
    for (namespace, name), translation in LIBRARY_OPS.items():
        if f"{namespace}::{name}" in registered:
            continue
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            registry.register_op(packet.default, translation)
            registered.add(f"{namespace}::{name}")


def grouped_mm_fallback(input: Any, weight: Any, offs: Any) -> Any:
    """transformers::grouped_mm_fallback: input (S, K) sorted by group, weight (G, K, N),
    offs (G,) the running row counts -> (S, N); rows past offs[-1] are zero."""
    return _row_groups(input, weight, offs, _groups(weight.shape[0], offs.shape[0]))


def grouped_mm_fallback_backward(input: Any, weight: Any, offs: Any, grad_output: Any) -> Any:
    """transformers::grouped_mm_fallback_backward: (grad_input, grad_weight), each group's
    products as the op's implementation computes them."""
    count = _groups(weight.shape[0], offs.shape[0])
    grad_input = _row_groups(grad_output, op.Transpose(weight, perm=[0, 2, 1]), offs, count)
    grad_weight = _inner_groups(op.Transpose(input, perm=[1, 0]), grad_output, offs, count)
    return grad_input, grad_weight


# Custom ops of libraries that lazygrad does not import: translated once they exist.
LIBRARY_OPS = {
    ("transformers", "grouped_mm_fallback"): grouped_mm_fallback,
    ("transformers", "grouped_mm_fallback_backward"): grouped_mm_fallback_backward,
}


def _aten_grouped_mm(torchlib: Callable | None) -> Callable:
    def aten_grouped_mm(
        self: Any, mat2: Any, offs: Any = None, bias: Any = None, out_dtype: int = -1
    ) -> Any:
        """aten::_grouped_mm with offsets: (S, K) x (G, K, N) groups the rows (the forward of
        an MoE layer and its input gradient; rows past the last group, which torch's kernel
        leaves unwritten, are zero), (M, S) x (S, N) groups the inner dimension into (G, M, N)
        (its weight gradient). Without offsets: torchlib's translation."""
        if offs is None and torchlib is not None:
            return torchlib(self, mat2, offs, bias, out_dtype)
        if offs is None or bias is not None:
            raise NotImplementedError("_grouped_mm with a bias, or without offsets")
        ranks = (len(self.shape), len(mat2.shape))
        if ranks == (2, 3):
            result = _row_groups(self, mat2, offs, _groups(mat2.shape[0], offs.shape[0]))
        elif ranks == (2, 2):
            result = _inner_groups(self, mat2, offs, _groups(offs.shape[0]))
        else:
            raise NotImplementedError(f"_grouped_mm of ranks {ranks} with offsets")
        if out_dtype is not None and out_dtype != -1:
            result = op.Cast(result, to=out_dtype)
        return result

    return aten_grouped_mm


def _bounds(offs: Any) -> Any:
    """(G + 1,) int64: group g holds rows bounds[g] .. bounds[g + 1] - 1."""
    ends = op.Cast(op.Reshape(offs, [-1]), to=onnx.TensorProto.INT64)
    return op.Concat(op.Constant(value_ints=[0]), ends, axis=0)


def _group(x: Any, bounds: Any, g: int, axis: int) -> Any:
    """Group g's slice of `x` along `axis` (possibly empty)."""
    return op.Slice(x, op.Slice(bounds, [g], [g + 1]), op.Slice(bounds, [g + 1], [g + 2]), [axis])


def _groups(*sizes: Any) -> int:
    """The number of groups: the first static one of `sizes` (the weight's leading size, the
    offsets' length; a call's offsets have a symbolic length in the trace)."""
    for size in sizes:
        if isinstance(size, int):
            return size
    raise NotImplementedError("grouped matmul with a dynamic number of groups")


def _row_groups(x: Any, weight: Any, offs: Any, count: int) -> Any:
    """x (S, K) rows grouped, weight (count, K, N) -> (S, N): group g's rows times weight[g];
    rows past the last group are zero."""
    bounds = _bounds(offs)
    blocks = [
        op.MatMul(_group(x, bounds, g, 0), op.Gather(weight, op.Constant(value_int=g), axis=0))
        for g in range(count)
    ]
    rows = op.Shape(x, start=0, end=1)
    tail = op.Sub(rows, op.Slice(bounds, [count], [count + 1]))
    columns = op.Shape(weight, start=2, end=3)
    zero = op.CastLike(op.Constant(value_float=0.0), x)
    zeros = op.Expand(zero, op.Concat(tail, columns, axis=0))
    return op.Concat(*blocks, zeros, axis=0)


def _inner_groups(a: Any, b: Any, offs: Any, count: int) -> Any:
    """a (M, S) columns grouped, b (S, N) rows grouped -> (count, M, N): group g's columns of
    `a` times its rows of `b` (zeros for a group with none)."""
    bounds = _bounds(offs)
    blocks = [
        op.Unsqueeze(op.MatMul(_group(a, bounds, g, 1), _group(b, bounds, g, 0)), [0])
        for g in range(count)
    ]
    return op.Concat(*blocks, axis=0)
