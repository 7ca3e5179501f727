"""ATen ops that ONNX cannot express as they are, written with ops that it can.

PyTorch's derivative formulas stay the source of every gradient; some of the ops they emit have
no ONNX translation (torchlib raises NotImplementedError for `convolution_backward`, and stock
ONNX Runtime has no ConvGrad kernel). Such an op is lowered here, at trace time, into ops that
export: convolution_backward into convolutions. Like torch._decomp's tables these compute the op
itself, not a gradient of anything, and every graph built with them is checked against torch's
own op (verify.py) before it serves a step.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: list[int] | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    if transposed:
        return NotImplemented  # torch raises, the capture fails: that signature falls back
    spatial = list(range(2, grad_output.dim()))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = _input_gradient(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[1]:
        grad_weight = _weight_gradient(grad_output, input, weight, stride, padding, dilation,
                                       groups)
    if output_mask[2]:
        grad_bias = aten.sum.dim_IntList(grad_output, [0, *spatial])
    return grad_input, grad_weight, grad_bias


def _input_gradient(grad_output, input, weight, stride, padding, dilation, groups):
    """The transposed convolution of the output gradient, cropped to the input's extent.

    Without output padding (ONNX wants it static, and it depends on the sizes) the transposed
    convolution covers every input position any window read; positions no window read (the
    trailing ones a strided window skips) get zero, as in eager.
    """
    dims = len(stride)
    full = aten.convolution.default(
        grad_output, weight, None, stride, [0] * dims, dilation, True, [0] * dims, groups
    )
    for axis in range(dims):
        extra = max(0, stride[axis] - 1 - padding[axis])
        if extra:
            pad = [0, 0] * dims
            pad[2 * (dims - 1 - axis) + 1] = extra
            full = aten.constant_pad_nd.default(full, pad, 0.0)
        full = aten.slice.Tensor(full, 2 + axis, padding[axis],
                                 padding[axis] + input.shape[2 + axis])
    return full


def _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups):
    """A convolution of the input by the output gradient (batch and channels swapped), with
    stride and dilation exchanged, per group."""
    batch, channels_in = input.shape[0], input.shape[1]
    channels_out = grad_output.shape[1]
    spatial_in, spatial_out = list(input.shape[2:]), list(grad_output.shape[2:])
    per_in, per_out = channels_in // groups, channels_out // groups
    dims = len(stride)
    x = aten.view.default(input, [batch, groups, per_in, *spatial_in])
    x = aten.permute.default(x, [2, 1, 0, *range(3, 3 + dims)])
    x = aten.reshape.default(x, [per_in, groups * batch, *spatial_in])
    w = aten.view.default(grad_output, [batch, groups, per_out, *spatial_out])
    w = aten.permute.default(w, [1, 2, 0, *range(3, 3 + dims)])
    w = aten.reshape.default(w, [groups * per_out, batch, *spatial_out])
    y = aten.convolution.default(x, w, None, dilation, padding, stride, False, [0] * dims, groups)
    kernel = list(weight.shape[2:])
    for axis in range(dims):
        y = aten.slice.Tensor(y, 2 + axis, 0, kernel[axis])
    y = aten.view.default(y, [per_in, groups, per_out, *kernel])
    y = aten.permute.default(y, [1, 2, 0, *range(3, 3 + dims)])
    return aten.reshape.default(y, list(weight.shape))


TABLE = {aten.convolution_backward.default: convolution_backward}
