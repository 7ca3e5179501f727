"""ATen ops that ONNX cannot express as they are, written with ops that it can.

PyTorch's derivative formulas stay the source of every gradient; some of the ops they emit have
no ONNX translation (torchlib raises NotImplementedError for `convolution_backward`, and stock
ONNX Runtime has no ConvGrad kernel). Such an op is lowered here, at trace time, into ops that
export: convolution_backward (plain and transposed) into convolutions, avg_pool2d_backward into
a transposed convolution, _adaptive_avg_pool2d_backward into two matrix products; and one op
whose translation ONNX Runtime runs wrong (an accumulating index_put, `accumulate_rows`). Like
torch._decomp's tables these compute the op itself, not a gradient of anything, and every graph
built with them is checked against torch's own op (verify.py) before it serves a step.
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
    spatial = list(range(2, grad_output.dim()))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:  # the input gradient of a transposed convolution is a convolution
            grad_input = aten.convolution.default(
                grad_output, weight, None, stride, padding, dilation, False, [0] * len(stride),
                groups,
            )
        else:
            grad_input = _input_gradient(grad_output, input, weight, stride, padding, dilation,
                                         groups)
    if output_mask[1]:
        # A transposed convolution's weight gradient is a convolution's with the roles of its
        # input and output exchanged.
        source, gradient = (grad_output, input) if transposed else (input, grad_output)
        grad_weight = _weight_gradient(gradient, source, weight, stride, padding, dilation,
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


def avg_pool2d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """Each window's gradient divided by the window's divisor, spread back over the window:
    the transposed convolution of a depthwise all-ones kernel. The divisor is the override, or
    the window's size, or (count_include_pad=False) its number of input elements: the average
    pooling, padding counted, of an all-ones image, times the window's size. (ceil_mode's
    clipped last windows are not lowered: the capture falls back.)"""
    if ceil_mode:
        return NotImplemented
    kernel = list(kernel_size) * (2 // len(kernel_size))
    stride = list(stride or kernel) * (2 // len(stride or kernel))
    padding = list(padding) * (2 // len(padding))
    size = kernel[0] * kernel[1]
    if divisor_override or count_include_pad:
        spread = aten.div.Scalar(grad_output, divisor_override or size)
    else:
        ones = aten.new_ones.default(input, [1, 1, input.shape[2], input.shape[3]])
        counted = aten.avg_pool2d.default(ones, kernel, stride, padding, False, True, None)
        spread = aten.div.Tensor(grad_output, aten.mul.Scalar(counted, size))
    channels = input.shape[1]
    window = aten.new_ones.default(input, [channels, 1, *kernel])
    return _input_gradient(spread, input, window, stride, padding, [1, 1], channels)


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """`P_h^T @ grad @ P_w`, with P the (output x input) averaging matrix of each axis: row o
    averages input positions floor(o*n/out) .. ceil((o+1)*n/out) - 1, as torch's windows do.
    Built from aranges of the (symbolic) input size, so one graph serves every size."""
    rows = _averaging(grad_output.shape[-2], input.shape[-2], grad_output)
    columns = _averaging(grad_output.shape[-1], input.shape[-1], grad_output)
    return torch.matmul(rows.transpose(0, 1), torch.matmul(grad_output, columns))


def _averaging(out: int, size: int, like: torch.Tensor) -> torch.Tensor:
    index = torch.arange(out, device=like.device)
    start = torch.div(index * size, out, rounding_mode="floor")
    end = torch.div((index + 1) * size + out - 1, out, rounding_mode="floor")
    position = torch.arange(size, device=like.device)
    inside = (position[None, :] >= start[:, None]) & (position[None, :] < end[:, None])
    weight = 1.0 / (end - start).to(like.dtype)
    return torch.where(inside, weight[:, None], torch.zeros((), dtype=like.dtype))


def accumulate_rows(
    self: torch.Tensor,
    indices: list[torch.Tensor | None],
    values: torch.Tensor,
    accumulate: bool = False,
) -> torch.Tensor:
    """`index_put(..., accumulate=True)` over the leading dimension (the backward of an
    embedding, of `weight[ids]`) as `scatter_add`, which exports as ScatterElements.

    torchlib exports it as ScatterND with reduction "add", which ONNX Runtime's CPU kernel runs
    on several threads without guarding duplicate indices (onnxruntime#23396): gradients came out
    wrong by up to a quarter, differently from run to run, and sometimes passed the check.
    ScatterElements' "add" runs sequentially. Other index_put forms are left as they are."""
    if not accumulate or len(indices) != 1 or indices[0] is None or not _integral(indices[0]):
        return NotImplemented
    index = indices[0]
    tail = self.shape[1:]
    rows = index.reshape(-1)
    rows = torch.where(rows < 0, rows + self.shape[0], rows)
    source = values.expand(*index.shape, *tail).reshape(rows.shape[0], *tail)
    return self.scatter_add(0, rows.reshape(-1, *([1] * len(tail))).expand(source.shape), source)


def _integral(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and tensor.dtype != torch.bool


TABLE = {
    aten.index_put.default: accumulate_rows,
    aten._unsafe_index_put.default: accumulate_rows,
    aten.convolution_backward.default: convolution_backward,
    aten.avg_pool2d_backward.default: avg_pool2d_backward,
    aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
}
