"""ATen ops that ONNX cannot express as they are, written with ops that it can.

PyTorch's derivative formulas stay the source of every gradient; some of the ops they emit have
no ONNX translation (torchlib raises NotImplementedError for `convolution_backward`, and stock
ONNX Runtime has no ConvGrad kernel), or a translation that differs from torch's op. Such an op
is lowered here, at trace time, into ops that export: convolution_backward (plain and
transposed) into convolutions and matrix products (one product each over the patches where the
windows tile the input: `_patch_gradients`); avg_pool2d_backward and avg_pool3d_backward (every
ceil_mode, padding and divisor) into a transposed convolution; avg_pool2d with divisor_override
(torchlib ignores the override) into a window sum; adaptive average pooling's backward into two
matrix products; adaptive max pooling (torch decomposes only even windows) into masked maxima,
its backward, and 3-D max pooling's, into a scatter-add; diagonal_scatter (torch's decomposition
mutates) into a select; an accumulating index_put, whose translation ONNX Runtime runs wrong,
into scatter_add (`accumulate_rows`); `x[ids]`, which torchlib translates with copies around its
GatherND, into `index_select` (`gather_rows`); a slice's and a select's gradient, which torch
writes into zeros by `slice_scatter` and `select_scatter` (translated as a scatter between
Transposes, and through an index as large as the gradient), into one Pad (`slice_as_pad`,
`select_as_pad`); `mv`, whose transposed form ONNX Runtime fuses wrong, into a matrix product
(`matrix_vector`); an unstable sort into the stable one (`stable_sort`), and an unsorted top-k
into the sorted one, checked where eager's order is not (`sorted_topk`); `searchsorted`,
medians and `kthvalue`, which ONNX lacks, into `bucketize` or counts of smaller elements
(`search_sorted`) and picks of a stable sort (`median_of_all`, `sorted_pick`); `atan2`,
`logaddexp`, a one-sided `clamp` and `sign` into forms with eager's values at zeros, infinities
and NaN, and beyond exp's range (`quadrant_atan2`, `stable_logaddexp`, `one_sided_clamp`,
`sign_as_eager`), and `copysign`, `signbit`, `fmax`, `fmin` and `hypot`, which ONNX lacks, into
forms with eager's values there too (`signed_copy`, `sign_bit`, `ignoring_nan`, `scaled_hypot`);
and attention's `_safe_softmax` into one that finds its masked rows in one reduction
(`safe_softmax`: a translation ORT runs in six passes); `random_(low, high)` into the `randint`
eager draws alike (`random_integers`); `max(dim)` of booleans into that of bytes
(`boolean_maximum`); a broadcasting `copy` into one of its source expanded (`broadcast_copy`);
RReLU out of training into its leaky ReLU (`rrelu_in_eval`); `masked_scatter`'s backward into a
scatter by rank (`masked_scatter_backward`); `masked_select` into an index by `nonzero`
(`masked_select`); `expm1` and `log1p`, which torchlib translates as `exp(x) - 1` and `log(1 +
x)` (all precision lost near 0, where these ops exist for), into Kahan's forms (`precise_expm1`,
`precise_log1p`); `lgamma` and its derivatives, which ONNX lacks, into their series
(`special.py`); layer, group and instance norm of a float16 or bfloat16 input into the op in
float32 (`in_float32`: their translations mix types where eager's kernels compute in float32).
Like torch._decomp's tables these compute the op itself, not a gradient of anything, and every
graph built with them is checked against its FX graph (verify.py) before it serves a step.
Replication padding and grid sampling are traced as torch._decomp's own decompositions
(`as_torch_decomposes`), whose gradients translate; `nn.Bilinear`'s op as one contraction
(`bilinear`); `cdist`'s fused kernel as the norms of the pairs' differences (`distances`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from lazygrad.capture import open_order, private, special, symbols

aten = torch.ops.aten
REDUCED_PRECISION = (torch.float16, torch.bfloat16)


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
    # One value stands for every axis (`padding="valid"` reaches ATen as [0]).
    stride, padding, dilation = (
        list(values) * len(spatial) if len(values) == 1 else list(values)
        for values in (stride, padding, dilation))
    grad_input = grad_weight = grad_bias = None
    if not transposed and _tiles(weight, stride, padding, dilation, groups):
        grad_input, grad_weight = _patch_gradients(grad_output, input, weight, output_mask)
    elif output_mask[0]:
        if transposed:  # the input gradient of a transposed convolution is a convolution
            grad_input = aten.convolution.default(
                grad_output, weight, None, stride, padding, dilation, False, [0] * len(stride),
                groups,
            )
        elif _flipped_pays(weight, stride, padding, dilation, groups):
            grad_input = _input_gradient_by_flipped_weight(grad_output, weight, padding, dilation,
                                                           groups)
        elif _columns_pay(grad_output, groups):
            grad_input = _input_gradient_by_columns(grad_output, input, weight, stride, padding,
                                                    dilation)
        else:
            grad_input = _input_gradient(grad_output, input, weight, stride, padding, dilation,
                                         groups)
    if output_mask[1] and grad_weight is None:
        if transposed or groups > 1:
            # A transposed convolution's weight gradient is a convolution's with the roles of
            # its input and output exchanged.
            source, gradient = (grad_output, input) if transposed else (input, grad_output)
            grad_weight = _weight_gradient(gradient, source, weight, stride, padding, dilation,
                                           groups)
        else:
            grad_weight = _weight_gradient_by_products(grad_output, input, weight, stride,
                                                       padding, dilation)
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


def _flipped_pays(weight: torch.Tensor, stride: list[int], padding: list[int],
                  dilation: list[int], groups: int) -> bool:
    """Whether a grouped convolution's input gradient is the convolution of the output gradient
    by the flipped weight: unstrided, padded at most as far as the kernel reaches. For a
    depthwise convolution (ConvNeXt's 7 x 7) ORT's grouped ConvTranspose took 2.3x its Conv of
    the same sizes (3.3 against 1.5 ms on [8, 32, 32, 32]); the flip copies the weight, small
    when grouped (an ungrouped ResNet's gained nothing: its flip is a copy of a large weight)."""
    kernel = weight.shape[2:]
    return groups > 1 and all(step == 1 for step in stride) and all(
        pad <= gap * (size - 1) for pad, gap, size in zip(padding, dilation, kernel))


def _input_gradient_by_flipped_weight(grad_output, weight, padding, dilation, groups):
    """The unstrided input gradient as a convolution: each group's weight with its input and
    output channels exchanged and its kernel flipped, the output gradient padded so that every
    input position sees the windows that read it."""
    channels_out, per_group_in, *kernel = weight.shape
    dims = len(kernel)
    per_group_out = channels_out // groups
    exchanged = aten.reshape.default(
        aten.permute.default(
            aten.reshape.default(weight, [groups, per_group_out, per_group_in, *kernel]),
            [0, 2, 1, *range(3, 3 + dims)]),
        [groups * per_group_in, per_group_out, *kernel])
    flipped = aten.flip.default(exchanged, list(range(2, 2 + dims)))
    reach = [gap * (size - 1) - pad for pad, gap, size in zip(padding, dilation, kernel)]
    return aten.convolution.default(grad_output, flipped, None, [1] * dims, reach,
                                    list(dilation), False, [0] * dims, groups)


def _tiles(weight: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int],
           groups: int) -> bool:
    """Whether the convolution's windows tile its input, side by side without overlap: stride
    = kernel, no padding, no dilation, ungrouped (a vision transformer's patch embedding). A
    1x1 convolution's gradients stay as they were (its one window is the input itself)."""
    return (groups == 1 and list(stride) == list(weight.shape[2:]) and not any(padding)
            and all(step == 1 for step in dilation) and math.prod(weight.shape[2:]) > 1)


def _patches(input: torch.Tensor, out_sizes: list, kernel: list[int]) -> torch.Tensor:
    """[batch x positions, C_in x kernel]: each window of a tiling convolution as a row (the
    input's positions past its last whole window are never read)."""
    dims = len(kernel)
    covered = input
    for axis, size in enumerate(input.shape[2:]):
        end = out_sizes[axis] * kernel[axis]
        if not (isinstance(size, int) and isinstance(end, int) and size == end):
            covered = aten.slice.Tensor(covered, 2 + axis, 0, end)
    tiled = aten.reshape.default(covered, _tiled_shape(input, out_sizes, kernel))
    return aten.reshape.default(aten.permute.default(tiled, _to_patches(dims)),
                                [-1, input.shape[1] * math.prod(kernel)])


def _tiled_shape(input: torch.Tensor, out_sizes: list, kernel: list[int]) -> list:
    """[batch, C, o1, k1, o2, k2, ...]"""
    return [input.shape[0], input.shape[1],
            *(size for pair in zip(out_sizes, kernel) for size in pair)]


def _to_patches(dims: int) -> list[int]:
    """The permutation [batch, C, o1, k1, o2, k2, ...] -> [batch, o1, o2, ..., C, k1, k2, ...]."""
    return [0, *(2 + 2 * axis for axis in range(dims)), 1, *(3 + 2 * axis for axis in range(dims))]


def _patch_gradients(grad_output, input, weight, output_mask):
    """The input and weight gradients of a tiling convolution (`_tiles`) as one matrix product
    each over its patches (`_patches`: a copy of the input permuted, not gathered window by
    window). As products per kernel position (`_weight_gradient_by_products`) a ViT's 16 x 16
    patch embedding was 256 products and as many window copies, and its input gradient a
    transposed convolution."""
    dims = grad_output.dim() - 2
    channels_out, kernel = grad_output.shape[1], list(weight.shape[2:])
    out_sizes = list(grad_output.shape[2:])
    grad_input = grad_weight = None
    if output_mask[1]:
        channels_first = aten.reshape.default(
            aten.permute.default(grad_output, [1, 0, *range(2, 2 + dims)]), [channels_out, -1])
        grad_weight = aten.reshape.default(
            aten.mm.default(channels_first, _patches(input, out_sizes, kernel)),
            list(weight.shape))
    if output_mask[0]:
        rows = aten.reshape.default(
            aten.permute.default(grad_output, [0, *range(2, 2 + dims), 1]), [-1, channels_out])
        columns = aten.mm.default(rows, aten.reshape.default(weight, [channels_out, -1]))
        tiled = _tiled_shape(input, out_sizes, kernel)
        to_patches = _to_patches(dims)
        grad_input = aten.reshape.default(
            aten.permute.default(aten.reshape.default(columns, [tiled[a] for a in to_patches]),
                                 [to_patches.index(axis) for axis in range(len(tiled))]),
            [*input.shape[:2], *(out * k for out, k in zip(out_sizes, kernel))])
        uncovered = [size - out * k for size, out, k in zip(input.shape[2:], out_sizes, kernel)]
        if any(not isinstance(size, int) or size for size in uncovered):
            grad_input = aten.constant_pad_nd.default(
                grad_input, [side for size in reversed(uncovered) for side in (0, size)], 0.0)
    return grad_input, grad_weight


# Output positions per image up to which an input gradient is one product over the batch and a
# col2im (`_input_gradient_by_columns`) rather than a transposed convolution. Measured on ORT's
# CPU (2 threads, batch 8, a 3x3 layer of as many channels in as out): 4 x 4 positions (512
# channels) 3.1 against 5.3 ms, 7 x 7 (256) 2.6 against 3.0; 14 x 14 (128) 2.9 against 2.6.
COLUMNS_UP_TO = 64


def _columns_pay(grad_output: torch.Tensor, groups: int) -> bool:
    """Whether a 2-D ungrouped convolution's input gradient is cheaper as columns: few static
    positions per image (ORT's transposed convolution runs one thin product per image there),
    float32 on the CPU (ONNX Runtime's Col2Im kernel; CUDA's transposed convolution is cuDNN's)."""
    spatial = grad_output.shape[2:]
    return (len(spatial) == 2 and groups == 1 and grad_output.dtype == torch.float32
            and grad_output.device.type == "cpu"
            and all(isinstance(size, int) for size in spatial)
            and spatial[0] * spatial[1] <= COLUMNS_UP_TO)


def _input_gradient_by_columns(grad_output, input, weight, stride, padding, dilation):
    """The input gradient as the columns each output position spreads back, [C_in x kernel
    positions, batch x positions], one matrix product over the whole batch, summed into the
    input's positions by col2im (`F.fold`), which covers exactly the input's extent."""
    batch, channels_out = grad_output.shape[0], grad_output.shape[1]
    positions = grad_output.shape[2] * grad_output.shape[3]
    gradient = aten.reshape.default(aten.permute.default(grad_output, [1, 0, 2, 3]),
                                    [channels_out, batch * positions])
    weights = aten.reshape.default(weight, [channels_out, -1])
    columns = aten.mm.default(aten.t.default(weights), gradient)
    columns = aten.permute.default(aten.reshape.default(columns, [-1, batch, positions]), [1, 0, 2])
    return aten.col2im.default(columns, list(input.shape[2:]), list(weight.shape[2:]),
                               list(dilation), list(padding), list(stride))


def _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups):
    """A convolution of the input by the output gradient (batch and channels swapped), with
    stride and dilation exchanged, per group."""
    batch, channels_in = input.shape[0], input.shape[1]
    channels_out = grad_output.shape[1]
    spatial_in, spatial_out = list(input.shape[2:]), list(grad_output.shape[2:])
    per_in, per_out = channels_in // groups, channels_out // groups
    dims = len(stride)
    x = aten.reshape.default(input, [batch, groups, per_in, *spatial_in])
    x = aten.permute.default(x, [2, 1, 0, *range(3, 3 + dims)])
    x = aten.reshape.default(x, [per_in, groups * batch, *spatial_in])
    w = aten.reshape.default(grad_output, [batch, groups, per_out, *spatial_out])
    w = aten.permute.default(w, [1, 2, 0, *range(3, 3 + dims)])
    w = aten.reshape.default(w, [groups * per_out, batch, *spatial_out])
    y = aten.convolution.default(x, w, None, dilation, padding, stride, False, [0] * dims, groups)
    kernel = list(weight.shape[2:])
    for axis in range(dims):
        y = aten.slice.Tensor(y, 2 + axis, 0, kernel[axis])
    y = aten.reshape.default(y, [per_in, groups, per_out, *kernel])
    y = aten.permute.default(y, [1, 2, 0, *range(3, 3 + dims)])
    return aten.reshape.default(y, list(weight.shape))


# Input channels up to which a weight gradient's windows are stacked into one product, [C_out,
# kernel x C_in], rather than one product of C_in columns per kernel position: ORT's products
# of a few columns waste most of each pass (2 threads, batch 8, 64 channels out; ms per weight
# gradient, one product per position against stacked): a 7 x 7 stem of 3 channels, stride 2,
# 56 x 56 positions, 110 against 41; 3 x 3 over 32 x 32, 3 channels 6.8 against 0.8, 8 channels
# 10.4 against 1.6; 16 channels over 28 x 28 4.8 against 2.2; 64 channels 17.2 against 22.9
# (the stack's copy costs more than its wider product gains).
STACKED_UP_TO = 16


def _weight_gradient_by_products(grad_output, input, weight, stride, padding, dilation):
    """An ungrouped convolution's weight gradient as one matrix product per kernel position:
    the output gradient, [C_out, batch x positions], times the input window that position
    reads, [batch x positions, C_in]. As a convolution (`_weight_gradient`) it ran in ONNX
    Runtime as one product per input channel with a single column per kernel position (a 1x1
    convolution's, a matrix-vector product): a ResNet's step took 3x eager's; these products
    are as long as the batch times the positions. Where `_per_image_pays`, each product is one
    per image, summed over the batch, and neither the input nor the output gradient is copied
    channels first. Over few input channels (`STACKED_UP_TO`: an image's colours) the windows
    are stacked into one product."""
    dims = len(stride)
    batch, channels_out, channels_in = input.shape[0], grad_output.shape[1], input.shape[1]
    kernel, out_sizes = list(weight.shape[2:]), list(grad_output.shape[2:])
    if any(padding):
        input = aten.constant_pad_nd.default(
            input, [side for size in reversed(padding) for side in (size, size)], 0.0)
    per_image = _per_image_pays(channels_out, channels_in, kernel, out_sizes,
                                list(input.shape[2:]))
    if per_image:  # [batch, C_out, positions] and windows of [batch, C_in, *positions]
        gradient, source = aten.reshape.default(grad_output, [batch, channels_out, -1]), input
    else:  # [C_out, batch x positions] and windows of [C_in, batch, *positions]
        channels_first = [1, 0, *range(2, 2 + dims)]
        gradient = aten.reshape.default(aten.permute.default(grad_output, channels_first),
                                        [channels_out, -1])
        source = aten.permute.default(input, channels_first)
    windows = []
    for offsets in itertools.product(*(range(size) for size in kernel)):
        window = source
        for axis, offset in enumerate(offsets):
            start = offset * dilation[axis]
            window = aten.slice.Tensor(window, 2 + axis, start,
                                       start + (out_sizes[axis] - 1) * stride[axis] + 1,
                                       stride[axis])
        windows.append(aten.reshape.default(
            window, [batch, channels_in, -1] if per_image else [channels_in, -1]))
    stacked = channels_in <= STACKED_UP_TO and len(windows) > 1
    if stacked:  # [batch, kernel x C_in, positions] or [kernel x C_in, batch x positions]
        windows = [aten.cat.default(windows, 1 if per_image else 0)]
    products = [
        aten.sum.dim_IntList(aten.bmm.default(gradient, aten.transpose.int(window, 1, 2)), [0])
        if per_image else aten.mm.default(gradient, aten.t.default(window))
        for window in windows
    ]
    if stacked:  # [C_out, kernel x C_in]
        by_position = aten.reshape.default(products[0], [channels_out, -1, channels_in])
        return aten.reshape.default(aten.permute.default(by_position, [0, 2, 1]),
                                    [channels_out, channels_in, *kernel])
    return aten.reshape.default(aten.stack.default(products, -1),
                             [channels_out, channels_in, *kernel])


def _per_image_pays(channels_out: int, channels_in: int, kernel: list[int], out_sizes: list,
                    padded_sizes: list) -> bool:
    """Whether a weight gradient's products are cheaper one per image: they then write each
    kernel position's [C_out, C_in] product once per image and sum them, where over the whole
    batch at once the input and the output gradient are each copied channels first (a
    ResNet's first stage, 64 channels of 56 x 56 at batch 16: 221-226 ms of ORT's kernels
    against 263-292, torch 211-225; its last, 512 channels of 7 x 7: 348 against 183). Sizes
    that are symbols keep the whole batch."""
    sizes = [channels_out, channels_in, *kernel, *out_sizes, *padded_sizes]
    if not all(isinstance(size, int) for size in sizes):
        return False
    written = math.prod(kernel) * channels_out * channels_in
    copied = channels_in * math.prod(padded_sizes) + channels_out * math.prod(out_sizes)
    return written < copied


def avg_pool_backward(dims: int) -> Callable[..., torch.Tensor]:
    """avg_pool2d_backward (dims 2) or avg_pool3d_backward (dims 3), lowered."""

    def lowered(grad_output: torch.Tensor, input: torch.Tensor, kernel_size: list[int],
                stride: list[int], padding: list[int], ceil_mode: bool,
                count_include_pad: bool, divisor_override: int | None) -> torch.Tensor:
        return _avg_pool_backward(grad_output, input, kernel_size, stride, padding,
                                  count_include_pad, divisor_override, dims)

    return lowered


def _avg_pool_backward(grad_output: torch.Tensor, input: torch.Tensor, kernel_size: list[int],
                       stride: list[int], padding: list[int], count_include_pad: bool,
                       divisor_override: int | None, dims: int) -> torch.Tensor:
    """Each window's gradient divided by the window's divisor, spread back over the window:
    the transposed convolution of a depthwise all-ones kernel. The divisor is the override, or
    the product over the axes of how many positions the window covers, as torch's kernel
    counts them: within the padded input (count_include_pad), or within the input alone. With
    ceil_mode the last window may reach past the padded input: it counts only what it covers,
    and the transposed convolution's overhang is cropped away."""
    if input.dim() == dims + 1:  # unbatched (channels, *spatial)
        return aten.squeeze.dim(_avg_pool_backward(
            aten.unsqueeze.default(grad_output, 0), aten.unsqueeze.default(input, 0), kernel_size,
            stride, padding, count_include_pad, divisor_override, dims), 0)
    kernel = list(kernel_size) * (dims // len(kernel_size))
    stride = list(stride or kernel) * (dims // len(stride or kernel))
    padding = list(padding) * (dims // len(padding))
    if divisor_override:
        spread = aten.div.Scalar(grad_output, divisor_override)
    else:
        counts = [
            _window_counts(grad_output.shape[axis - dims], input.shape[axis - dims], kernel[axis],
                           stride[axis], padding[axis], count_include_pad, grad_output)
            for axis in range(dims)
        ]
        divisor = counts[0]
        for count in counts[1:]:  # their outer product, one axis per window axis
            divisor = divisor[..., None] * count
        spread = aten.div.Tensor(grad_output, divisor)
    channels = input.shape[1]
    window = aten.new_ones.default(input, [channels, 1, *kernel])
    return _input_gradient(spread, input, window, stride, padding, [1] * dims, channels)


def avg_pool2d(
    input: torch.Tensor,
    kernel_size: list[int],
    stride: list[int] = (),
    padding: list[int] = (0, 0),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """With `divisor_override` (torchlib ignores it): each window's sum, divided by the
    override. The sum is the average over the window's input elements (count_include_pad=False,
    which ONNX and torch count alike) times their number. Without it: the op as it is."""
    if not divisor_override:
        return NotImplemented
    kernel = list(kernel_size) * (2 // len(kernel_size))
    stride = list(stride or kernel) * (2 // len(stride or kernel))
    padding = list(padding) * (2 // len(padding))
    average = aten.avg_pool2d.default(input, kernel, stride, padding, ceil_mode, False, None)
    rows, columns = (
        _window_counts(average.shape[-2 + axis], input.shape[-2 + axis], kernel[axis],
                       stride[axis], padding[axis], False, average)
        for axis in range(2)
    )
    return aten.div.Scalar(average * (rows[:, None] * columns[None, :]), divisor_override)


def _window_counts(out: int, size: int, kernel: int, stride: int, padding: int,
                   include_padding: bool, like: torch.Tensor) -> torch.Tensor:
    """Per output position of one axis: how many positions its window covers within
    [-padding, size + padding) (include_padding) or within [0, size). Built from aranges of
    the (symbolic) sizes, so one graph serves every size."""
    position = torch.arange(size + 2 * padding, device=like.device) - padding
    start = torch.arange(out, device=like.device) * stride - padding
    window = (position[None, :] >= start[:, None]) & (position[None, :] < start[:, None] + kernel)
    if not include_padding:
        window = window & (position[None, :] >= 0) & (position[None, :] < size)
    return window.sum(-1).to(like.dtype)


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """`P_h^T @ grad @ P_w`, with P the (output x input) averaging matrix of each axis: row o
    averages input positions floor(o*n/out) .. ceil((o+1)*n/out) - 1, as torch's windows do.
    Built from aranges of the (symbolic) input size, so one graph serves every size."""
    rows = _averaging(grad_output.shape[-2], input.shape[-2], grad_output)
    columns = _averaging(grad_output.shape[-1], input.shape[-1], grad_output)
    return torch.matmul(rows.transpose(0, 1), torch.matmul(grad_output, columns))


def _averaging(out: int, size: int, like: torch.Tensor) -> torch.Tensor:
    inside = _adaptive_windows(out, size, like)
    weight = 1.0 / inside.sum(-1).to(like.dtype)
    return torch.where(inside, weight[:, None], torch.zeros((), dtype=like.dtype))


def _adaptive_windows(out: int, size: int, like: torch.Tensor) -> torch.Tensor:
    """(out, size) booleans: output o's window holds input positions floor(o*size/out) ..
    ceil((o+1)*size/out) - 1, as torch's adaptive pooling windows do."""
    index = torch.arange(out, device=like.device)
    start = torch.div(index * size, out, rounding_mode="floor")
    end = torch.div((index + 1) * size + out - 1, out, rounding_mode="floor")
    position = torch.arange(size, device=like.device)
    return (position[None, :] >= start[:, None]) & (position[None, :] < end[:, None])


def adaptive_max_pool2d(
    input: torch.Tensor, output_size: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's decomposition covers only windows that divide the input evenly; here every case:
    the maximum over each window's columns, then over its rows, each with the first position
    that holds it, so the index (row * width + column) is the first maximum in row-major order,
    as torch's kernel picks it. The backward, `adaptive_max_pool2d_backward`, scatters by it."""
    height, width = input.shape[-2], input.shape[-1]
    rows = _adaptive_windows(output_size[0], height, input)  # (out_h, height)
    columns = _adaptive_windows(output_size[1], width, input)  # (out_w, width)
    lowest = torch.full((), float("-inf"), dtype=input.dtype, device=input.device)
    # (..., height, out_w, width) -> max over width: (..., height, out_w)
    by_column = torch.where(columns, input[..., :, None, :], lowest)
    column_max, column_at = by_column.max(-1)
    # (..., out_h, height, out_w) -> max over height: (..., out_h, out_w)
    by_row = torch.where(rows[:, :, None], column_max[..., None, :, :], lowest)
    values, row_at = by_row.max(-2)
    column = torch.gather(column_at[..., None, :, :].expand(by_row.shape), -2,
                          row_at[..., None, :]).squeeze(-2)
    return values, row_at * width + column


def adaptive_max_pool2d_backward(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    return _add_at_indices(grad_output, input, indices, 2)


def max_pool3d_with_indices_backward(
    grad_output: torch.Tensor, input: torch.Tensor, kernel_size: list[int], stride: list[int],
    padding: list[int], dilation: list[int], ceil_mode: bool, indices: torch.Tensor,
) -> torch.Tensor:
    """The windows decided the indices: torch's decomposition of the 2-D op, in 3-D."""
    return _add_at_indices(grad_output, input, indices, 3)


def _add_at_indices(grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor,
                    spatial: int) -> torch.Tensor:
    """Each output's gradient added at the input position its index names (a position in its
    channel's plane or volume, row-major)."""
    positions = math.prod(input.shape[-spatial:])
    flat = aten.new_zeros.default(grad_output, [*input.shape[:-spatial], positions])
    added = torch.scatter_add(flat, -1, indices.flatten(-spatial),
                              grad_output.flatten(-spatial))
    return added.reshape(input.shape)


def diagonal_scatter(
    input: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> torch.Tensor:
    """`input` with its diagonal (offset, dim1, dim2) replaced by `src`, without mutation.

    torch's own decomposition (torch._refs) copies into a diagonal view: a mutation that the
    trace's decomposition pass leaves unfunctionalized (`prims.copy_to`, and AOTAutograd
    refuses the graph). It is the backward of `torch.diagonal` (and of einsum's repeated
    indices, "ii->i"). Here: `src` spread over the (dim1, dim2) plane by each position's index
    along the diagonal, chosen where the position lies on it.
    """
    dims = input.dim()
    dim1, dim2 = dim1 % dims, dim2 % dims
    rows = torch.arange(input.shape[dim1], device=input.device)[:, None]
    columns = torch.arange(input.shape[dim2], device=input.device)[None, :]
    on_diagonal = (columns - rows) == offset
    if src.shape[-1] == 0:
        return aten.clone.default(input)
    along = (rows if offset >= 0 else columns).expand(on_diagonal.shape)
    along = torch.clamp(along, 0, src.shape[-1] - 1)
    spread = torch.movedim(src[..., along], (-2, -1), (dim1, dim2))
    on_diagonal = torch.movedim(on_diagonal.reshape([1] * (dims - 2) + list(on_diagonal.shape)),
                                (-2, -1), (dim1, dim2))
    return torch.where(on_diagonal, spread, input)


def matrix_vector(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """`mv` as a product with a one-column matrix: ONNX Runtime 1.32 (CPU) fuses a Transpose
    into a MatMul whose second input has one dimension and computes another value (the
    backward of any `mv`, and spectral_norm's power iteration `W.T @ u`, read such a
    transpose); with two dimensions its fusion is right."""
    return aten.squeeze.dim(aten.mm.default(matrix, aten.unsqueeze.default(vector, -1)), -1)


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
    ScatterElements' "add" runs sequentially. One index tensor on a later dimension (full
    slices before it: `x[:, idx] += v`, and `unfold`'s backward, whose int32 index torchlib
    handed to ScatterND, which ORT refused) is the same on that dimension moved to the front.
    Other index_put forms are left as they are. On the CPU a float16 or bfloat16 one adds in
    float32, rounded once at the end (ORT's CPU ScatterElements has no half-precision "add":
    Swin in `.half()`, its position-bias table's gradient, failed at the check's run)."""
    if not accumulate or not indices or indices[-1] is None or not _integral(indices[-1]) \
            or any(index is not None for index in indices[:-1]):
        return NotImplemented
    if self.dtype in REDUCED_PRECISION and self.device.type == "cpu":
        wide = accumulate_rows(self.to(torch.float32), indices, values.to(torch.float32), True)
        return wide.to(self.dtype)
    index, dim = indices[-1], len(indices) - 1
    if dim:
        values = values.expand(*self.shape[:dim], *index.shape, *self.shape[dim + 1:])
        values = values.movedim(tuple(range(dim, dim + index.dim())), tuple(range(index.dim())))
        return accumulate_rows(self.movedim(dim, 0), [index], values, True).movedim(0, dim)
    tail = self.shape[1:]
    rows = _from_the_end(index.reshape(-1).to(torch.int64), self.shape[0])
    source = values.expand(*index.shape, *tail).reshape(rows.shape[0], *tail)
    return self.scatter_add(0, rows.reshape(-1, *([1] * len(tail))).expand(source.shape), source)


def gather_rows(self: torch.Tensor, indices: list[torch.Tensor | None]) -> torch.Tensor:
    """`x[ids]` (`aten.index` with one integer index tensor, full slices around it) as
    `index_select` along that dimension, which exports as one Gather.

    torchlib exports every `index` as GatherND between two Transposes, which keep the
    dimensions' order here, and ONNX Runtime ran them as copies of the result: a
    Mixture-of-Experts layer gathering each token's expert weights ([512, 512, 128]) spent 60 ms
    a step in each. Negative ids count from the end, as `index` takes them; an id out of range
    fails in both, as before."""
    positions = [d for d, index in enumerate(indices) if index is not None]
    if len(positions) != 1 or indices[positions[0]].dtype not in (torch.int64, torch.int32):
        return NotImplemented
    dim = positions[0]
    index = indices[dim]
    picked = self.index_select(dim, _from_the_end(index.reshape(-1), self.shape[dim]))
    return picked.view(*self.shape[:dim], *index.shape, *self.shape[dim + 1:])


def slice_as_pad(grad_output: torch.Tensor, input_sizes: list[int], dim: int, start: int,
                 end: int, step: int) -> torch.Tensor:
    """`slice_backward` (a slice's gradient: zeros but where the slice was) as the slice padded
    with zeros: one Pad, a single write of the result.

    torch decomposes it into zeros and a `slice_scatter`, which torchlib translates as a
    ScatterND between Transposes that move the dimension first: for the half of a rotary
    embedding ([4, 4, 64, 16] into [4, 4, 64, 32]; the backward of every RoPE layer has four),
    ORT took 237 us where Pad takes 18 and torch 10. A strided slice, or a start that is not a
    number, keeps torch's decomposition."""
    if step != 1 or not isinstance(start, int):
        return _decomposed(aten.slice_backward)(
            grad_output, input_sizes, dim, start, end, step)
    dim %= len(input_sizes)
    before = _clamped_start(start, input_sizes[dim])
    return _padded_along(grad_output, dim, before,
                         input_sizes[dim] - before - grad_output.shape[dim])


def select_as_pad(grad_output: torch.Tensor, input_sizes: list[int], dim: int,
                  index: int) -> torch.Tensor:
    """`select_backward` as the selected row padded with zeros: one Pad, where torch's
    `select_scatter` into zeros is a ScatterElements through an index as large as the gradient
    (torchlib's translation). An index that is not a number keeps torch's decomposition."""
    if not isinstance(index, int):
        return _decomposed(aten.select_backward)(grad_output, input_sizes, dim, index)
    dim %= len(input_sizes)
    row = index + input_sizes[dim] if index < 0 else index  # select checked the range
    return _padded_along(grad_output.unsqueeze(dim), dim, row, input_sizes[dim] - row - 1)


def _clamped_start(start: int, size: int) -> int:
    """Where a slice starting at `start` starts in `size` elements, as `slice` clamps it (a
    symbolic size is compared symbolically, without a guard)."""
    if start < 0:
        start = torch.sym_max(start + size, 0)
    return torch.sym_min(start, size)


def _padded_along(tensor: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [before, after]  # last dimension first
    return aten.constant_pad_nd.default(tensor, pad, 0.0)


def _decomposed(packet: torch._ops.OpOverloadPacket) -> Callable[..., torch.Tensor]:
    """torch's own decomposition of `packet`'s default overload."""
    return private.get_decompositions([packet])[packet.default]


def _from_the_end(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Indices into `size` elements, negative ones counted from the end, as indexing takes them
    (`index_select`, `scatter_add` and ONNX's Gather and ScatterElements would not)."""
    return torch.where(ids < 0, ids + size, ids)


def stable_sort(
    self: torch.Tensor, dim: int = -1, descending: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort` (stable=False) as the stable sort, which is one of the orders it may return.

    An unstable sort leaves the order of equal values open, and torch's CPU kernel and ONNX's
    TopK (which breaks ties by index: stable) chose differently: a Mixture-of-Experts layer
    sorting its rows by expert id got another permutation from ORT than from its FX graph,
    and the check refused the graph. Sorted stably, both agree (the exporter's registry
    translates `sort.stable` with torchlib's TopK, trace.onnx_registry)."""
    return aten.sort.stable(self, stable=True, dim=dim, descending=descending)


def sorted_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                sorted: bool = True) -> object:
    """`topk(sorted=False)` as `topk(sorted=True)`. Where eager returns it sorted too (one pick,
    or on the CPU at most 1/64 of the dimension: torch's kernel then picks by a partial sort),
    that is eager's order. Elsewhere eager's order is its kernel's own (an introselect's), which
    ONNX Runtime's TopK does not reproduce; the pick is noted (`open_order`) and the build's
    check proves that nothing the graphs return depends on the order, or refuses them
    (Informer's attention pairs its Dropout mask with the picks in that order; a router's
    picks gathered and scattered back by the same indices pass). A sorted `topk` is traced as
    it is (NotImplemented: no decomposition)."""
    if sorted:
        return NotImplemented
    picks = aten.topk.default(self, k, dim, largest, True)
    size = self.shape[dim] if self.dim() else 1
    if not (k == 1 or (self.device.type == "cpu" and isinstance(k, int)
                       and isinstance(size, int) and k * 64 <= size)):
        open_order.note(picks, dim)
    return picks


def search_sorted(sorted_sequence: torch.Tensor, self: torch.Tensor, *, out_int32: bool = False,
                  right: bool = False, side: str | None = None,
                  sorter: torch.Tensor | None = None) -> torch.Tensor:
    """`searchsorted`, which ONNX lacks (NeRF's sampling by a CDF, a spline's bins): over one
    sequence the values' `bucketize`, which translates; over rows, each value's count of its
    row's elements below it (at or below it, `right`), which in a sorted row is the index
    searchsorted returns."""
    right = right or side == "right"
    if sorter is not None:
        sorted_sequence = sorted_sequence.gather(-1, sorter)
    if sorted_sequence.dim() == 1:
        return aten.bucketize.Tensor(self, sorted_sequence, out_int32=out_int32, right=right)
    rows, values = sorted_sequence.unsqueeze(-2), self.unsqueeze(-1)
    below = rows <= values if right else rows < values
    return below.sum(-1, dtype=torch.int32 if out_int32 else torch.int64)


def median_of_all(self: torch.Tensor) -> torch.Tensor:
    """`median()` of every element, which ONNX lacks: the lower middle of them sorted, NaN where
    one is (as eager). Its gradient stays torch's formula (shared among the equal elements)."""
    flat = self.reshape(-1)
    middle = aten.sort.stable(flat, stable=True)[0][(flat.shape[0] - 1) // 2]
    if not self.is_floating_point():
        return middle
    return torch.where(flat.isnan().any(), flat.new_full((), math.nan), middle)


def sorted_pick(self: torch.Tensor, position: int, dim: int, keepdim: bool) -> object:
    """The value at `position` of each row sorted along `dim`, and its index: `median(dim)` and
    `kthvalue`, which ONNX lacks. Among equal values eager's index is its kernel's choice, this
    the first: a call with such a tie (or, for the median, a NaN) runs in eager PyTorch
    (`checks._PICKS`)."""
    if self.dim() == 0:
        return NotImplemented
    values, indices = aten.sort.stable(self, stable=True, dim=dim)
    values, indices = values.narrow(dim, position, 1), indices.narrow(dim, position, 1)
    return (values, indices) if keepdim else (values.squeeze(dim), indices.squeeze(dim))


def median_along(self: torch.Tensor, dim: int, keepdim: bool = False) -> object:
    return sorted_pick(self, (self.shape[dim] - 1) // 2 if self.dim() else 0, dim, keepdim)


def kth_along(self: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False) -> object:
    return sorted_pick(self, k - 1, dim, keepdim)


def quadrant_atan2(self: torch.Tensor, other: torch.Tensor) -> object:
    """`atan2(y, x)` as eager (C's `atan2`) computes it at every input. torchlib's translation
    takes the quadrant from `y > 0` and maps NaN to 0: a vector on the negative x-axis,
    (y, x) = (0, -1), got -pi where eager gives pi, a NaN came out 0, and signed zeros and two
    infinities lost their angles (eager: atan2(-0, -0) = -pi, atan2(inf, -inf) = 3 pi / 4).
    Here the angle of (y, |x|), whose quotient keeps a zero's sign (two zeros: y / 1; two
    infinities: their signs'), mirrored where x's sign bit is set. ORT's Where returns -0.0 as
    0.0 from its first branch (it merges the branches by `x != 0 ? x : y`): y stays in the
    second. Its gradient stays torch's formula."""
    if not (self.is_floating_point() and other.is_floating_point()):
        return NotImplemented
    infinite = self.isinf() & other.isinf()
    zeros = ((self == 0) & (other == 0)).to(self.dtype)
    angle = torch.atan(torch.where(infinite, self.sign(), self)
                       / torch.where(infinite, 1.0, other.abs() + zeros))
    mirrored = _sign_bit(other).to(angle.dtype)
    half_turn = torch.where(_sign_bit(self), angle.new_full((), -math.pi),
                            angle.new_full((), math.pi))
    return angle * (1 - 2 * mirrored) + half_turn * mirrored


def one_sided_clamp(self: torch.Tensor, min: object = None, max: object = None) -> object:
    """`clamp` by one bound as `maximum` or `minimum` with it: ONNX Runtime's Clip without one
    bound clips to the type's largest finite value, so an infinity came out as 3.4e38 (65504
    in float16) where eager keeps it: an overflow that GradScaler would have found and skipped
    trained on as a finite number (`F.normalize` clamps its norms below). Both bounds, or
    none: traced as it is."""
    if not self.is_floating_point() or (min is None) == (max is None):
        return NotImplemented
    bound = min if min is not None else max
    if not isinstance(bound, torch.Tensor):
        bound = self.new_full((), bound)
    elif bound.dtype != self.dtype:  # (the result's type is promoted: eager's op decides it)
        return NotImplemented
    return torch.maximum(self, bound) if min is not None else torch.minimum(self, bound)


def clamp_below(self: torch.Tensor, min: object) -> object:
    return one_sided_clamp(self, min=min)


def clamp_above(self: torch.Tensor, max: object) -> object:
    return one_sided_clamp(self, max=max)


def stable_logaddexp(base_two: bool) -> Callable[..., object]:
    """`logaddexp` or (`base_two`) `logaddexp2` as eager's kernels compute them: the larger
    plus the log of one plus the smaller's share, infinities of one sign themselves. torchlib
    translates them as log(exp(a) + exp(b)), which overflows: `logaddexp(0, 100)` came out
    infinite (eager: 100), and 2 ** -100 underflowed to nothing."""

    def kernel(self: torch.Tensor, other: torch.Tensor) -> object:
        if not (self.is_floating_point() and other.is_floating_point()):
            return NotImplemented
        gap = -(self - other).abs()
        share = torch.log1p(torch.exp2(gap)) * (1 / math.log(2)) if base_two \
            else torch.log1p(torch.exp(gap))
        return torch.where(self.isinf() & (self == other), self,
                           torch.maximum(self, other) + share)

    return kernel


def sign_as_eager(self: torch.Tensor) -> object:
    """`sign` (and `sgn` of real numbers, which torch decomposes into it) as eager's kernel
    computes it, (0 < x) - (x < 0): 0 for NaN, where ONNX's Sign gives NaN."""
    if not self.is_floating_point():
        return NotImplemented
    return (self > 0).to(self.dtype) - (self < 0).to(self.dtype)


def signed_copy(self: torch.Tensor, other: object) -> object:
    """`copysign(a, b)` as |a| times b's sign, its sign bit read arithmetically. torch
    decomposes it through `signbit`, which ONNX lacks (the module ran in parts), into a
    selection that would carry -0.0 in ORT's Where's first branch (dropped there)."""
    if not self.is_floating_point():
        return NotImplemented
    if not isinstance(other, torch.Tensor):
        other = self.new_full((), other)
    return self.abs() * (1 - 2 * _sign_bit(other).to(self.dtype))


def sign_bit(self: torch.Tensor) -> object:
    """`signbit`, which ONNX lacks: negative or -0.0 (`_sign_bit`)."""
    return _sign_bit(self) if self.is_floating_point() else NotImplemented


def ignoring_nan(pick: Callable[..., torch.Tensor]) -> Callable[..., object]:
    """`fmax` (`pick` maximum) or `fmin` (minimum): the other value where one is NaN. torch
    decomposes them into prims that ONNX lacks (the module ran in parts)."""

    def kernel(self: torch.Tensor, other: torch.Tensor) -> object:
        if not (self.is_floating_point() and other.is_floating_point()):
            return NotImplemented
        return pick(torch.where(self.isnan(), other, self), torch.where(other.isnan(), self, other))

    return kernel


def scaled_hypot(self: torch.Tensor, other: torch.Tensor) -> object:
    """`hypot`, which ONNX lacks (torch decomposes it into a prim): the larger magnitude times
    sqrt(1 + ratio^2), which neither overflows nor underflows where the squares would (as C's
    `hypot`); an infinity's is infinite, NaN beside it included."""
    if not (self.is_floating_point() and other.is_floating_point()):
        return NotImplemented
    x, y = self.abs(), other.abs()
    larger = torch.maximum(x, y)
    ratio = torch.minimum(x, y) / torch.where(larger == 0, 1.0, larger)
    result = larger * torch.sqrt(1 + ratio * ratio)
    return torch.where(x.isinf() | y.isinf(), math.inf, result)


def _sign_bit(x: torch.Tensor) -> torch.Tensor:
    """Whether `x` is negative, -0.0 included (1 / -0.0 is -inf); NaN's is False."""
    return (x < 0) | ((x == 0) & (x.reciprocal() < 0))


def broadcast_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> object:
    """`copy(self, src)` (a functionalized `self.copy_(src)`, a slice assignment) broadcasts
    `src` to `self`'s shape; torchlib's translation hands `src` on as it is, and a smaller
    source gave a tensor of another rank (grid sampling's reflection and bicubic modes: ORT
    refused the graph, and the module ran in parts). The source expanded first; a source of
    `self`'s shape is traced as it is."""
    if symbols.same_sizes(src.shape, self.shape):
        return NotImplemented
    cast = aten._to_copy.default(src, dtype=self.dtype)
    return aten.clone.default(aten.expand.default(cast, list(self.shape)))


def rrelu_in_eval(self: torch.Tensor, noise: torch.Tensor, lower: float = 0.125,
                  upper: float = 1 / 3, training: bool = False,
                  generator: object = None) -> object:
    """RReLU out of training is a leaky ReLU of slope (lower + upper) / 2, as eager's kernel
    computes it, with no draw; traced as its random op, it was refused as one (a model with
    RReLU ran in parts in eval mode). In training its draws depend on the values (one per
    negative element), so it stays as it is, refused."""
    if training:
        return NotImplemented
    return aten.leaky_relu.default(self, (lower + upper) / 2), noise


def masked_scatter_backward(grad_output: torch.Tensor, mask: torch.Tensor,
                            sizes: list[int]) -> torch.Tensor:
    """The source's gradient of `masked_scatter` (a vision-language model writes its image
    features into the text embeddings so): the output gradient at the mask's positions, in
    order, in the source's first elements, zeros after them. torch's kernel picks them with
    `masked_select`, whose size is data, and the op has no ONNX translation (the model ran in
    parts). Here each position's place in the source is its rank among the mask's positions
    (a running count), and the others go to one more slot, dropped; each place receives one
    value, so the sum that puts it there is exact."""
    count = math.prod(sizes)
    selected = mask.expand_as(grad_output).reshape(-1)
    place = torch.cumsum(selected.to(torch.int64), 0) - 1
    place = torch.where(selected, place, count)
    gathered = grad_output.new_zeros(count + 1).scatter_add(0, place, grad_output.reshape(-1))
    return gathered[:count].view(sizes)


def masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`masked_select` (no ONNX translation) as the elements at the mask's non-zero positions,
    in order: a length the data gives (`data_lengths.py`), which NonZero computes."""
    values, where = torch.broadcast_tensors(self, mask)
    return values.reshape(-1)[where.reshape(-1).nonzero().squeeze(1)]


def boolean_maximum(self: torch.Tensor, dim: int, keepdim: bool = False) -> object:
    """`max(dim)` of a boolean tensor (whether a row holds a zero, in `cumprod`'s backward) as
    the maximum of its bytes: ONNX Runtime has no ArgMax of booleans and refused the graph.
    The same values and first indices; other dtypes are traced as they are."""
    if self.dtype != torch.bool:
        return NotImplemented
    values, indices = aten.max.dim(self.to(torch.uint8), dim, keepdim)
    return values.to(torch.bool), indices


def random_integers(self: torch.Tensor, low: int, high: int | None = None, *,
                    generator: object = None) -> object:
    """`empty_like(x).random_(low, high)` (`random.from`, `random.to`) as `randint(low, high)`,
    which eager draws with the same kernel call (`empty(size).random_(low, high)`), so it is
    drawn outside the graph as eager draws it (`draws.py`). Traced as it is, its overload,
    named `from`, made the trace's Python code invalid, and the model ran in parts. A tensor
    of another layout (filled in its memory order) or a full-range draw are left as they are."""
    if high is None or generator is not None or not self.is_contiguous():
        return NotImplemented
    return aten.randint.low(low, high, self.shape, dtype=self.dtype, device=self.device)


def random_integers_below(self: torch.Tensor, high: int, *, generator: object = None) -> object:
    """`random_(high)`: `random_integers` from 0."""
    return random_integers(self, 0, high, generator=generator)


def _integral(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and tensor.dtype != torch.bool


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`torch._weight_norm` as torch computes it off CPU and CUDA, instead of the fused
    `_weight_norm_interface` it takes there."""
    return v * (g / aten.norm_except_dim.default(v, 2, dim))


def embedding_bag(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`torch.embedding_bag` in sum and mean modes as what it computes: each bag's rows (times
    their per-sample weights; rows of `padding_idx` left out) added up, divided by their count
    for the mean (an empty bag is zeros). Its other results as the fused `_embedding_bag`
    returns them for these modes, which only that op's backward reads. Max mode and gradients
    scaled by frequency or sparse: the fused op, as without lazygrad."""
    if mode == 2 or scale_grad_by_freq or sparse or indices.dim() != 1:
        return aten._embedding_bag.default(
            weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
            include_last_offset, -1 if padding_idx is None else padding_idx)
    count = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    positions = torch.arange(indices.shape[0], device=indices.device)
    bag_of = (positions[:, None] >= offsets[None, :count]).sum(-1) - 1
    rows = aten.embedding.default(weight, indices)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    kept = torch.ones_like(indices, dtype=weight.dtype)
    if padding_idx is not None and padding_idx >= 0:
        kept = (indices != padding_idx).to(weight.dtype)
        rows = rows * kept[:, None]
    spread = bag_of[:, None].expand(rows.shape)
    summed = torch.scatter_add(weight.new_zeros(count, weight.shape[1]), 0, spread, rows)
    sizes = torch.scatter_add(weight.new_zeros(count), 0, bag_of, kept)
    if mode == 1:
        summed = summed / torch.clamp(sizes, min=1)[:, None]
    return summed, bag_of, sizes.to(torch.long), torch.zeros_like(sizes, dtype=torch.long)


def adaptive_avg_pool2d(input: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    """torch's own path (a mean, for a 1x1 output) without the restride it gives the mean of a
    channels-last input (`as_strided_`, whose backward, as_strided_scatter, has no ONNX
    translation: AdaptiveAvgPool1d(1) of a transposed sequence, Swin's pooler). The values are
    the same; only the strides of the size-1 dimensions differ."""
    if list(output_size) == [1, 1]:
        return aten.mean.dim(input, [-1, -2], True)
    return aten._adaptive_avg_pool2d.default(input, output_size)


def adaptive_avg_pool3d(input: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    """As `adaptive_avg_pool2d`, in 3-D."""
    if list(output_size) == [1, 1, 1]:
        return aten.mean.dim(input, [-1, -2, -3], True)
    return aten._adaptive_avg_pool3d.default(input, output_size)


def precise_expm1(self: torch.Tensor) -> torch.Tensor:
    """`expm1` to within a few roundings, as torch's kernel computes it. torchlib's `exp(x) - 1`
    keeps no digit of a result near 0 (x = 1e-4 in float32: 1e-3 off; an xIELU activation's
    gradient for its negative slope came out 3e-4 off eager's). Kahan's form: with u = exp(x)
    rounded, (u - 1) * x / log(u) is exact to a few roundings; u = 1 gives x, u = 0 gives -1, an
    overflow gives infinity."""
    exp = aten.exp.default(self)
    less_one = aten.sub.Tensor(exp, 1)
    precise = aten.div.Tensor(aten.mul.Tensor(less_one, self), aten.log.default(exp))
    precise = aten.where.self(aten.isinf.default(exp), exp, precise)
    precise = aten.where.self(aten.eq.Scalar(less_one, -1), less_one, precise)
    return aten.where.self(aten.eq.Scalar(exp, 1), self, precise)


def precise_log1p(self: torch.Tensor) -> torch.Tensor:
    """`log1p` to within a few roundings (torchlib's `log(1 + x)` loses what 1 + x rounds away:
    all of x below 6e-8 in float32). Goldberg's form: with u = 1 + x rounded, log(u) * x /
    (u - 1), which gives -infinity at u = 0 itself; u = 1 gives x, u = infinity itself."""
    plus_one = aten.add.Tensor(self, 1)
    precise = aten.div.Tensor(aten.mul.Tensor(aten.log.default(plus_one), self),
                              aten.sub.Tensor(plus_one, 1))
    precise = aten.where.self(aten.eq.Scalar(plus_one, math.inf), plus_one, precise)
    return aten.where.self(aten.eq.Scalar(plus_one, 1), self, precise)


def safe_softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`_safe_softmax` (scaled dot-product attention's math path: a row that is all -inf, fully
    masked, gives zeros, not NaNs), with the masked rows found by one reduction: the row's
    maximum is -inf exactly when every element is (a NaN row's maximum is NaN, not masked, as
    in torch's). torch's decomposition compares every element with -inf, casts twice, reduces,
    and expands a zero tensor for the select: six passes over each layer's attention scores,
    where eager's fused attention makes none. Its gradient stays torch's formula for the op
    (`_softmax_backward_data`)."""
    out = aten._softmax.default(input, dim, False) if dtype is None else \
        aten._softmax.default(input.to(dtype), dim, False)
    masked_rows = aten.eq.Scalar(aten.amax.default(input, [dim], True), float("-inf"))
    zero = aten.scalar_tensor.default(0.0, dtype=out.dtype, device=out.device)
    return aten.where.self(masked_rows, zero, out)


def in_float32(op: torch._ops.OpOverload) -> Callable[..., object]:
    """A normalization (`op`: its input first, its parameters float tensors among the other
    arguments; the normalized input first among its results, then its statistics) of a float16
    or bfloat16 input, as eager's kernels compute it: in float32, the result rounded to the
    input's type. torchlib's translations of layer norm and of batch norm without running
    statistics (instance norm) mix the two types in one ONNX op (LayerNormalization takes one
    type for its input and parameters, an Add met float32 and float16), so the graphs of mixed
    precision (autocast, or a model in half precision) did not load in ORT, and the model ran
    in eager PyTorch; group norm's gives its statistics another type than eager's. The
    statistics (saved for the backward) take the type eager's kernel gives them: float32 on
    CUDA or beside float32 parameters, else the input's. A float32 or float64 input: the op
    as it is."""

    def kernel(input: torch.Tensor, *args: object, **kwargs: object) -> object:
        if input.dtype not in REDUCED_PRECISION:
            return NotImplemented
        parameters = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        normalized, *statistics = op(input.to(torch.float32), *(
            a.to(torch.float32) if any(a is p for p in parameters) else a for a in args),
            **kwargs)
        mixed = any(p.dtype != input.dtype for p in parameters)
        kept = torch.float32 if input.device.type != "cpu" or mixed else input.dtype
        return (normalized.to(input.dtype), *(s.to(kept) for s in statistics))

    return kernel


def as_torch_decomposes(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    """`op` as torch's own decomposition (torch._decomp) computes it: replication padding and
    grid sampling by indexing (`_unsafe_index`, with clamped or interpolated positions), whose
    gradient, an accumulating index_put, translates (`accumulate_rows`); the ops' own backward
    ops (`replication_pad2d_backward`, `grid_sampler_2d_backward`) have no ONNX translation,
    and the model ran in parts. An affine grid too: `affine_grid_generator`'s own kernel takes
    exact sizes only, so a spatial transformer's batch size that changed failed the trace with
    sizes as symbols, and each batch size got graphs of its own."""

    def kernel(*args: object) -> torch.Tensor:
        return private.decomposition_table[op](*args)

    return kernel


def grid_sampler(input: torch.Tensor, grid: torch.Tensor, interpolation_mode: int,
                 padding_mode: int, align_corners: bool) -> torch.Tensor:
    """Grid sampling as torch's decomposition computes it (`as_torch_decomposes`). In nearest
    mode (1) it rounds the positions, so the grid gets no gradient at all, where eager's
    backward gives it zeros (a spatial transformer's localisation layers got `None`, and AdamW
    skipped their weight decay): the grid joins the result through a selection that never
    picks it, whose gradient is those zeros, and whose value is the sample's, bit for bit."""
    sampled = private.decomposition_table[aten.grid_sampler_2d.default](
        input, grid, interpolation_mode, padding_mode, align_corners)
    if interpolation_mode != 1:
        return sampled
    never = torch.zeros((), dtype=torch.bool, device=grid.device)
    return torch.where(never, grid.sum().to(sampled.dtype), sampled)


def dropout(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """`dropout` as eager computes it: without a draw (p 0, or not training) it hands its input
    through. torch's decomposition returns a clone, another tensor than eager's: a module whose
    output a Linear made through Dropout(p=0) (eager's: a view of the Linear's product, the
    trace's: a clone) ran in parts, refused for outputs that share memory unlike eager's."""
    if train and p != 0:
        return aten.native_dropout.default(input, p, train)[0]
    return input


# The most elements of the pairwise differences a lowered `cdist` makes (`distances`): 4 MiB.
DIFFERENCES_AT_MOST = 1 << 20


def distances(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0,
              compute_mode: int | None = None) -> torch.Tensor:
    """`torch.cdist` where eager takes the fused `_cdist_forward` (every p but 2, and 2 with at
    most 25 rows on both sides), whose backward op has no ONNX translation (a prototypical
    network's 5-way episode or an L1 codebook lookup ran in parts): the p-norm of every pair's
    difference, whose gradient (`vector_norm`'s) is the fused op's, zero at zero distance too.
    Left as torch computes it: euclidean distances by products (that path translates), p = inf
    (the norm's gradient splits a tie, the fused op gives each tied element all of it), and
    pairs whose differences would exceed DIFFERENCES_AT_MOST elements (the fused op never makes
    them)."""
    mode = 0 if compute_mode is None else compute_mode
    rows, columns = x1.size(-2), x2.size(-2)
    by_products = p == 2 and (mode == 1 or (mode == 0 and (rows > 25 or columns > 25)))
    batch = math.prod(torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]))
    if (by_products or p == math.inf or x1.numel() == 0 or x2.numel() == 0
            or batch * rows * columns * x1.size(-1) > DIFFERENCES_AT_MOST):
        return private.own_composite_kernel(aten.cdist.default)(x1, x2, p, compute_mode)
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p, -1)


def bilinear(input1: torch.Tensor, input2: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """`nn.Bilinear`'s op, x1^T W_o x2 (+ b_o) for each output o, as one contraction: torch's
    kernel is `_trilinear`, which has no ONNX translation, nor has its backward (biaffine
    scorers ran in parts)."""
    out = torch.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias


# Ops traced as what they compute (`private.composite_kernels`), above autograd: the backward
# ops of their own kernels (fused, or restrided) have no ONNX translation; and `dropout` as
# eager computes it.
COMPOSITE = {
    aten.bilinear.default: bilinear,
    aten.cdist.default: distances,
    aten.dropout.default: dropout,
    aten._weight_norm.default: weight_norm,
    aten.embedding_bag.padding_idx: embedding_bag,
    aten.adaptive_avg_pool2d.default: adaptive_avg_pool2d,
    aten.adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    aten.grid_sampler_2d.default: grid_sampler,
    **{op: as_torch_decomposes(op) for op in (
        aten.replication_pad1d.default, aten.replication_pad2d.default,
        aten.replication_pad3d.default, aten.affine_grid_generator.default)},
}

TABLE = {
    aten.mv.default: matrix_vector,
    aten.index_put.default: accumulate_rows,
    aten._unsafe_index_put.default: accumulate_rows,
    aten.index.Tensor: gather_rows,
    aten._unsafe_index.Tensor: gather_rows,
    aten.slice_backward.default: slice_as_pad,
    aten.select_backward.default: select_as_pad,
    aten.convolution_backward.default: convolution_backward,
    aten.avg_pool2d.default: avg_pool2d,
    aten.avg_pool2d_backward.default: avg_pool_backward(2),
    aten.avg_pool3d_backward.default: avg_pool_backward(3),
    aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
    aten.diagonal_scatter.default: diagonal_scatter,
    aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
    aten.adaptive_max_pool2d_backward.default: adaptive_max_pool2d_backward,
    aten.max_pool3d_with_indices_backward.default: max_pool3d_with_indices_backward,
    aten.sort.default: stable_sort,
    aten.topk.default: sorted_topk,
    aten.searchsorted.Tensor: search_sorted,
    aten.atan2.default: quadrant_atan2,
    aten.clamp.default: one_sided_clamp,
    aten.clamp.Tensor: one_sided_clamp,
    aten.clamp_min.default: clamp_below,
    aten.clamp_min.Tensor: clamp_below,
    aten.clamp_max.default: clamp_above,
    aten.clamp_max.Tensor: clamp_above,
    aten.logaddexp.default: stable_logaddexp(base_two=False),
    aten.logaddexp2.default: stable_logaddexp(base_two=True),
    aten.sign.default: sign_as_eager,
    aten.copysign.Tensor: signed_copy,
    aten.copysign.Scalar: signed_copy,
    aten.signbit.default: sign_bit,
    aten.fmax.default: ignoring_nan(torch.maximum),
    aten.fmin.default: ignoring_nan(torch.minimum),
    aten.hypot.default: scaled_hypot,
    aten.median.default: median_of_all,
    aten.median.dim: median_along,
    aten.kthvalue.default: kth_along,
    aten.max.dim: boolean_maximum,
    aten.masked_scatter_backward.default: masked_scatter_backward,
    aten.masked_select.default: masked_select,
    aten.rrelu_with_noise_functional.default: rrelu_in_eval,
    aten.copy.default: broadcast_copy,
    aten._safe_softmax.default: safe_softmax,
    aten.expm1.default: precise_expm1,
    aten.log1p.default: precise_log1p,
    **{op: in_float32(op) for op in (
        aten.native_layer_norm.default, aten.native_group_norm.default,
        aten._native_batch_norm_legit.no_stats)},
    getattr(aten.random, "from"): random_integers,  # `from` is a Python keyword
    aten.random.to: random_integers_below,
    **special.TABLE,
}
