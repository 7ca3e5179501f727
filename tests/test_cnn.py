"""A ResNet-18-shaped CNN trains through ORT as it trains in eager PyTorch, BatchNorm included.

`lazygrad.examples.models.ResNet18` rather than torchvision's (its wheel here is a CUDA build
that breaks imports next to CPU torch): the ResNet-18 layout with BasicBlocks, at small widths.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ran_through_ort

import lazygrad
from lazygrad import attach
from lazygrad.capture import reshaped_outputs
from lazygrad.examples.models import ResNet18

RTOL, ATOL = 1e-4, 1e-5


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """|actual - expected| <= ATOL + RTOL * max |expected|, per tensor: the tolerance scales with
    the tensor's largest entry, not each entry's own (as in conftest and verify.py). Twenty
    convolutions and BatchNorms deep, float32 rounding leaves absolute errors near 1e-5 of a
    gradient's largest entry in eager itself (measured against float64 gradients: eager 1e-5,
    ORT 3e-5 on the same weights), so small entries have no 1e-4 relative accuracy to compare."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= ATOL + RTOL * scale, f"{what}: error {error:.2e}, largest entry {scale:.2e}"


def _assert_grads_close(lazy: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    """Every gradient close to eager's, and `.grad is None` exactly where eager's is."""
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}.grad is None differs"
        if q.grad is not None:
            _assert_close(p.grad, q.grad, f"{what}: {name}.grad")


def _assert_state_equal(lazy: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    """Parameters and buffers: BatchNorm's running statistics and num_batches_tracked."""
    for (name, got), want in zip(lazy.state_dict().items(), eager.state_dict().values()):
        if got.is_floating_point():
            _assert_close(got, want, f"{what}: {name}")
        else:
            assert torch.equal(got, want), f"{what}: {name}"


def test_resnet18_shaped_cnn_trains_through_ort_like_eager_running_statistics_included():
    torch.manual_seed(0)
    eager = ResNet18()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (lazy, eager)]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):  # step 0 runs eagerly and builds; steps 1 and 2 run through ORT
        x = torch.randn(2, 3, 64, 64, generator=generator)
        labels = torch.randint(0, 10, (2,), generator=generator)
        losses, outputs = [], []
        for model, optimizer in zip((lazy, eager), optimizers):
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, labels)
            loss.backward()
            losses.append(loss.detach())
            outputs.append(out)
        _assert_close(losses[0], losses[1], f"step {step} loss")
        _assert_close(outputs[0].detach(), outputs[1].detach(), f"step {step} output")
        _assert_grads_close(lazy, eager, f"step {step}")
        _assert_state_equal(lazy, eager, f"step {step} before the update")
        if step > 0:
            assert ran_through_ort(outputs[:1]), f"step {step}"
        for optimizer in optimizers:
            optimizer.step()
        _assert_state_equal(lazy, eager, f"step {step} after the update")
    assert int(lazy.bn1.num_batches_tracked) == 3
    for model in (lazy, eager):
        model.eval()
    for call in range(2):  # eval mode: running statistics, and no update of them
        x = torch.randn(3, 3, 64, 64, generator=generator)
        with torch.no_grad():
            _assert_close(lazy(x), eager(x), f"eval call {call}")
    _assert_state_equal(lazy, eager, "after eval")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0
    assert stats.builds == 2  # the training pair of the one mask, the eval inference graph


def _three_steps_like_eager(eager: torch.nn.Module, shape: tuple[int, ...],
                            layout: torch.memory_format = torch.contiguous_format
                            ) -> torch.nn.Module:
    """A lazy copy of `eager` and eager itself, three steps on random inputs of `shape` in
    `layout` (the sum of the output's squares): outputs and gradients alike at every step, the
    last two through ORT with no fallback and no break. Returns the lazy model."""
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        x = torch.randn(*shape).to(memory_format=layout)
        for module in (lazy, eager):
            module.zero_grad(set_to_none=True)
        got, want = lazy(x), eager(x)
        _assert_close(got, want, f"step {step}: output")
        got.square().sum().backward()
        want.square().sum().backward()
        _assert_grads_close(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    return lazy


def test_an_ungrouped_convolutions_weight_gradient_is_matrix_products():
    """As a convolution of the input by the output gradient, ORT ran it as one thin product
    per input channel (a 1x1 convolution's a matrix-vector product): a ResNet-50's step took
    3x eager's. It is one product per kernel position over the batch and positions; strided,
    dilated and padded weight gradients stay eager's."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=2, dilation=2), torch.nn.Tanh(),
        torch.nn.Conv2d(8, 4, 1), torch.nn.Flatten())
    lazy = _three_steps_like_eager(eager, (2, 3, 11, 13))
    (entry,) = attach.installed(lazy)._pairs.values()
    backward = [node.op_type for node in entry.pair.graphs.backward.graph.node]
    # The second convolution's input gradient (6 x 7 positions) is columns summed by a Col2Im
    # (`lowerings._input_gradient_by_columns`); no Conv is left.
    assert "Conv" not in backward and backward.count("Col2Im") == 1, backward
    # Each kernel-shaped weight gradient leaves ORT as its products' stack, viewed in torch:
    # a Reshape making a graph output would be a copy (capture/reshaped_outputs.py).
    graph = entry.pair.graphs.backward.graph
    made_by = {output: node.op_type for node in graph.node for output in node.output}
    assert [made_by[value.name] for value in graph.output].count("Reshape") == 0, made_by
    assert len(reshaped_outputs.unreshaped(entry.pair.graphs.backward)) == 2  # both kernels


@pytest.mark.parametrize("groups", [1, 2])
def test_valid_padding_convolutions_train_through_ort(groups):
    """`padding="valid"` reaches ATen as one padding for every axis ([0]): the lowering's
    per-axis reads failed the trace (an IndexError ungrouped and grouped, col2im's "only 2D
    padding" for the columns), and Hugging Face's EfficientNet ran in 29 parts."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, stride=2, padding="valid"), torch.nn.Tanh(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding="valid", groups=groups), torch.nn.Flatten())
    _three_steps_like_eager(eager, (2, 4, 19, 17))


@pytest.mark.parametrize(("channels", "size", "per_image"), [(4, 24, True), (32, 3, False)])
def test_weight_gradient_products_are_per_image_where_that_copies_less(channels, size, per_image):
    """Few channels over many positions (a ResNet's first stage): one product per image and
    kernel position, summed over the batch, reading windows of the input as it is laid out.
    Many channels over few positions (its last stage): one product over the whole batch, the
    input and the output gradient copied channels first, where the per-image products would
    write more than those copies."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1),
                                torch.nn.Flatten())
    lazy = _three_steps_like_eager(eager, (2, channels, size, size))
    (entry,) = attach.installed(lazy)._pairs.values()
    graph = entry.pair.graphs.backward.graph
    channels_first = [node for node in graph.node if node.op_type == "Transpose" and list(
        next(a.ints for a in node.attribute if a.name == "perm"))[:2] == [1, 0]]
    assert len(channels_first) == (0 if per_image else 2), [n.name for n in channels_first]


@pytest.mark.parametrize(("channels", "products"), [(3, 1), (32, 9)])
def test_a_weight_gradient_over_few_input_channels_is_one_product_of_its_stacked_windows(
        channels, products):
    """ORT's products of a few columns waste most of each pass: a 7 x 7 stem over an image's 3
    colours took 2.7x as long as one product of its 49 windows stacked. Over many input
    channels each kernel position keeps its own product (the stack's copy costs more)."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(channels, 8, 3, stride=2, padding=1),
                                torch.nn.Flatten())
    lazy = _three_steps_like_eager(eager, (2, channels, 9, 9))
    (entry,) = attach.installed(lazy)._pairs.values()
    backward = [node.op_type for node in entry.pair.graphs.backward.graph.node]
    assert sum(backward.count(op) for op in ("MatMul", "FusedMatMul", "Gemm")) == products


@pytest.mark.parametrize("size", [9, 32])
def test_an_input_gradient_is_columns_over_few_positions_and_a_transposed_convolution_else(size):
    """ORT's transposed convolution runs one thin product per image where the output has few
    positions (4 x 4: 5.3 ms against 3.1 for the columns, measured): there the input gradient
    is one product over the batch and ONNX's Col2Im, which must give eager's gradient for any
    stride, padding and dilation; with many positions it stays a transposed convolution."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 1), torch.nn.ReLU(),
        torch.nn.Conv2d(6, 8, 3, stride=2, padding=2, dilation=2), torch.nn.Tanh(),
        torch.nn.Conv2d(8, 4, (3, 2), stride=(1, 2), padding=(1, 0)), torch.nn.Flatten())
    lazy = _three_steps_like_eager(eager, (2, 3, size, size + 1))
    (entry,) = attach.installed(lazy)._pairs.values()
    backward = [node.op_type for node in entry.pair.graphs.backward.graph.node]
    # The input gradients of the second and third convolutions (the first's is not needed)
    few = size == 9
    assert backward.count("Col2Im") == (2 if few else 0), backward
    assert backward.count("ConvTranspose") == (0 if few else 2), backward


@pytest.mark.parametrize("groups", [1, 2])
def test_a_channels_last_cnn_trains_through_ort_like_eager(groups):
    """`model.to(memory_format=torch.channels_last)`, as torchvision's training recipes do: the
    convolutions' lowered gradients flattened the weight and the output gradient by `view`,
    which a channels-last tensor refuses ("Cannot view a tensor with shape [64, 64, 3, 3] and
    strides (576, 1, 192, 64)"): the trace failed and a ResNet ran in parts, its convolutions
    each on their own. Grouped convolutions (a ResNeXt's) take another lowering."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=groups), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 1), torch.nn.Flatten(),
    ).to(memory_format=torch.channels_last)
    _three_steps_like_eager(eager, (2, 3, 6, 6), torch.channels_last)


class Patches(torch.nn.Module):
    """Convolutions whose windows tile their input (stride = kernel: vision transformers'
    patch embeddings, 1-D to 3-D), one over an input its windows do not cover to the end."""

    def __init__(self) -> None:
        super().__init__()
        self.image = torch.nn.Conv2d(3, 8, 4, stride=4)
        self.signal = torch.nn.Conv1d(3, 5, 3, stride=3, bias=False)
        self.video = torch.nn.Conv3d(3, 4, (1, 2, 2), stride=(1, 2, 2))

    def forward(self, x):
        return torch.cat([self.image(x).flatten(1), self.signal(x.flatten(2)).flatten(1),
                          self.video(x.unsqueeze(2)).flatten(1)], 1)


def test_a_tiling_convolutions_gradients_are_one_product_each():
    """A convolution whose windows tile its input: its weight gradient is one product over its
    patches (a permutation of the input), where it was one product and one window copy per
    kernel position (a ViT's 16 x 16 patch embedding: 256 of each), and its input gradient one
    product permuted back (zeros where no window reads), where it was a transposed convolution.
    Over an input whose last rows and columns no window reads, and one that each covers."""
    torch.manual_seed(0)
    for shape in ((2, 3, 18, 17), (2, 3, 16, 16)):
        eager = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), Patches())
        lazy = _three_steps_like_eager(eager, shape)
        (entry,) = attach.installed(lazy)._pairs.values()
        backward = [node.op_type for node in entry.pair.graphs.backward.graph.node]
        assert not {"Conv", "ConvTranspose"} & set(backward), backward
        # Three weight gradients and three input gradients of the tiling convolutions, and the
        # first convolution's weight gradient (3 channels in: its 9 windows stacked, one product).
        products = sum(backward.count(op) for op in ("MatMul", "FusedMatMul", "Gemm"))
        assert products == 6 + 1, backward


def test_a_grouped_unstrided_convolutions_input_gradient_is_a_convolution_by_its_flipped_weight():
    """ORT's grouped ConvTranspose took 2.3x its Conv of the same sizes on a depthwise 7 x 7
    (ConvNeXt's); unstrided, the input gradient is a convolution of the output gradient by each
    group's weight with its channels exchanged and its kernel flipped. Depthwise and grouped,
    dilated, padded less than the kernel reaches."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 7, padding=3, groups=8),
        torch.nn.GELU(), torch.nn.Conv2d(8, 16, 3, padding=1, dilation=2, groups=4))
    lazy = _three_steps_like_eager(eager, (2, 3, 11, 12))
    (entry,) = attach.installed(lazy)._pairs.values()
    backward = [node.op_type for node in entry.pair.graphs.backward.graph.node]
    assert "ConvTranspose" not in backward, backward
    assert backward.count("Conv") == 4, backward  # two input gradients, two weight gradients
