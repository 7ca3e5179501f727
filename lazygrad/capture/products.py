"""The ONNX translation of `prims.prod`, which torchlib leaves unimplemented.

torch's own decompositions reduce with it: `torch._refs.prod`, and `cumprod` (each prefix's
product, `_cumsumprod_common`), which the backward of `prod` calls for inputs that may hold
zeros (`prod_safe_zeros_backward`). A model with `torch.prod` or `torch.cumprod` (a
transmittance along a ray, a stick-breaking weight) ran in parts. ONNX's ReduceProd computes
the op as its definition does; every graph is checked against its FX graph (verify.py). The
reference `cumprod` multiplies a masked copy of its input per position along the dimension: a
dimension of n elements takes n times its input's memory (a ray of 128 samples: 128x).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
from onnxscript import opset18 as op


def prims_prod(inp: Any, dims: Sequence[int] | None, output_dtype: int | None = None) -> Any:
    """prod(Tensor inp, int[]? dims, *, ScalarType? output_dtype=None) -> Tensor"""
    if output_dtype is not None and output_dtype != -1:
        inp = op.Cast(inp, to=output_dtype)
    if dims is None:
        return op.ReduceProd(inp, keepdims=0)
    if not dims:
        return op.Identity(inp)
    axes = op.Constant(value=onnx.helper.make_tensor("axes", onnx.TensorProto.INT64,
                                                      [len(dims)], list(dims)))
    return op.ReduceProd(inp, axes, keepdims=0)
