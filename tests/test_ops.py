"""Ops that real models use, each through ORT with eager's outputs and gradients.

Their backward ops either translate to ONNX, or are lowered at trace time into ops that do
(`capture/lowerings.py`: convolution_backward, plain and transposed; average pooling with
ceil_mode and divisor_override; adaptive pooling; diagonal_scatter) or traced as another
path of the op (weight_norm, EmbeddingBag, replication padding, grid_sample). Each op's
options that take another path are results of the same model (one build per op). Embedding
with padding_idx: tests/test_capture.py.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_close,
    assert_grads_equal,
    ran_through_ort,
    squares_step_like_eager,
    sum_step_like_eager,
)

import lazygrad
from lazygrad import attach
from lazygrad.capture import lowerings
from lazygrad.capture.trace import onnx_registry
from lazygrad.session import GraphSession


def _cat(*parts: torch.Tensor) -> torch.Tensor:
    """Several results of one op (different options) as one output (batch, features)."""
    return torch.cat([part.flatten(1) for part in parts], 1)


def _ties(h: torch.Tensor) -> torch.Tensor:
    """Every value twice, side by side: windows and reductions meet exact ties (eager splits
    amax's gradient between them and gives max's to the index it returns)."""
    return h.repeat_interleave(2, -1)


def _max_pool(h):
    values, indices = F.max_pool2d(_ties(h), 3, stride=2, padding=1, ceil_mode=True,
                                   return_indices=True)
    return _cat(F.max_pool2d(h, 2), values + 0 * indices)


def _avg_pool(h):
    return _cat(F.avg_pool2d(h, 3, stride=2, padding=1, count_include_pad=False),
                F.avg_pool2d(h, 3, stride=2, padding=1, ceil_mode=True),
                F.avg_pool2d(h[0], 3, stride=2, ceil_mode=True, divisor_override=4)[None].expand(
                    len(h), -1, -1, -1))


def _max_min_reductions(h):
    tied = _ties(h)
    return _cat(tied.amax(dim=(2, 3)), tied.amin(-1, keepdim=True), tied.max(1).values,
                tied.min(dim=-1, keepdim=True).values)


def _padded(h):
    """Replication padding's backward has no translation (traced as torch decomposes it,
    `lowerings.as_torch_decomposes`); reflection's decomposes in the exporter."""
    return _cat(F.pad(h, (1, 2, 2, 1), mode="replicate"), F.pad(h, (2, 1, 1, 2), mode="reflect"),
                F.pad(h.flatten(2), (3, 1), mode="replicate"),
                F.pad(h, (1, 1, 1, 1), mode="circular"),
                F.pad(h[:, None], (1, 1, 1, 1, 1, 0), mode="replicate"))


def _sampled(h):
    """grid_sample (spatial transformers, deformable sampling): its backward has no
    translation (traced as torch decomposes it), in each mode and padding mode."""
    theta = torch.tensor([[0.9, 0.2, 0.1], [-0.2, 0.8, -0.1]]).expand(len(h), 2, 3)
    grid = F.affine_grid(theta, list(h.shape), align_corners=False) * 1.2
    return _cat(*(F.grid_sample(h, grid, mode=mode, padding_mode=padding, align_corners=corners)
                  for mode, padding, corners in (("bilinear", "zeros", False),
                                                 ("bilinear", "border", True),
                                                 ("nearest", "reflection", False),
                                                 ("bicubic", "zeros", False))))


def _attention(h):
    """Scaled dot-product attention's math path (`_safe_softmax`, lowered to one reduction for
    its masked rows: `lowerings.safe_softmax`): a fully masked row gives zeros, as in eager,
    under a boolean mask and under an additive one."""
    q = h.flatten(2)  # (batch, 4 positions, features)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[2] = False
    bias = torch.zeros(4, 4).masked_fill(~mask, float("-inf"))
    return _cat(F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=mask),
                F.scaled_dot_product_attention(q, q, q.flip(-1), attn_mask=bias),
                F.scaled_dot_product_attention(q, q, q, is_causal=True))


def _complex_assigned(h):
    """Real values written into a complex tensor (a slice assignment: `slice_scatter` of a
    real source), then complex products (`complex_pairs._same_op`)."""
    pairs = torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2))
    assigned = torch.zeros_like(pairs)
    assigned[..., :2] = h[..., :2]
    assigned[..., 2:] = pairs[..., 2:]
    return torch.view_as_real(assigned * pairs).flatten(1)


class LearnedGrid(torch.nn.Module):
    """A spatial transformer: its affine grid is learned, so the backward differentiates grid
    sampling with respect to the grid. Reflection padding and bicubic sampling write a
    coordinate's gradient with a broadcasting `copy`, which torchlib's translation did not
    broadcast (`lowerings.broadcast_copy`): ORT refused the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor([[0.9, 0.2, 0.1], [-0.2, 0.8, -0.1]]))

    modes = (("bilinear", "reflection"), ("bicubic", "border"))

    def forward(self, h):
        grid = F.affine_grid(self.theta.expand(len(h), 2, 3), list(h.shape), align_corners=False)
        return _cat(*(F.grid_sample(h, grid * 1.2, mode=mode, padding_mode=padding,
                                    align_corners=False)
                      for mode, padding in self.modes))


class LearnedNearestGrid(LearnedGrid):
    """Nearest sampling alone: eager's backward gives the grid, and so `theta`, a gradient of
    zeros; torch's decomposition gave it none (`.grad` None: AdamW skipped its decay)."""

    modes = (("nearest", "zeros"),)


def _accumulated(h):
    """Positions picked along a later dimension, repeated ones among them (`x[:, :, i]`), and
    sliding windows (`unfold`): each backward sums into those positions with an accumulating
    `index_put` on that dimension (`lowerings.accumulate_rows`). torchlib translates it as a
    ScatterND, which ORT refused for `unfold`'s int32 index, and whose "add" ORT's CPU kernel
    runs on several threads without guarding repeated positions (onnxruntime#23396)."""
    windows = h.unfold(-1, 3, 2)
    return _cat(h[:, :, torch.tensor([0, 2, 2, 7, 0])] * 2, windows * windows.flip(-1))


def _ranked(h):
    """`searchsorted` (over one sequence and over rows, either side, with a sorter), medians and
    `kthvalue`, which ONNX lacks (`lowerings.search_sorted`, `median_of_all`, `sorted_pick`),
    at values distinct within each row; positions of exact ties with the edges among them."""
    rows = h.flatten(2)  # (batch, channels, 64)
    edges = torch.tensor([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0])
    on_edges = torch.cat([rows[..., :4], edges.expand(*rows.shape[:2], -1)], -1)
    positions = [torch.searchsorted(edges, on_edges), torch.bucketize(on_edges, edges, right=True),
                 torch.searchsorted(rows.sort(-1).values, on_edges),
                 torch.searchsorted(rows, on_edges, side="right", sorter=rows.argsort(-1),
                                    out_int32=True)]
    median, median_at = rows.median(-1)
    kth, kth_at = rows.kthvalue(5, -1, keepdim=True)
    return _cat(*(p.float() for p in positions), median, median_at.float(), kth, kth_at.float(),
                rows.median().expand(len(h), 1), h)


def _distances(h):
    """`cdist` where eager takes its fused kernel, whose backward has no translation
    (`lowerings.distances`): few rows (a prototypical network's episode), p other than 2, the
    direct mode; a set against itself has zero distances, whose gradient is zero."""
    rows = h.flatten(2)  # (batch, channels, 64)
    other = rows.flip(1) * 0.5
    return _cat(torch.cdist(rows, rows), torch.cdist(rows, other, p=1.0),
                torch.cdist(rows, other, p=3.0), torch.cdist(rows, other, p=1.5),
                torch.cdist(rows, other, compute_mode="donot_use_mm_for_euclid_dist"))


OPS = {
    "ranked": _ranked,
    "distances": _distances,
    "attention": _attention,
    "max_pool": _max_pool,
    "padding": _padded,
    "grid_sample": _sampled,
    "grid_sample_learned": LearnedGrid(),
    "grid_sample_nearest_learned": LearnedNearestGrid(),
    "avg_pool": _avg_pool,
    "adaptive_avg_pool": lambda h: F.adaptive_avg_pool2d(h, (2, 3)),
    "adaptive_max_pool": lambda h: F.adaptive_max_pool2d(_ties(h), (3, 5)),
    # A mean restrided by torch for a channels-last input (Swin's pooler: a transposed sequence)
    "global_avg_pool_channels_last": lambda h: _cat(
        F.adaptive_avg_pool1d(h.flatten(2).transpose(1, 2), 1),
        F.adaptive_avg_pool2d(h.contiguous(memory_format=torch.channels_last), 1)),
    "upsample_nearest": lambda h: _cat(F.interpolate(h, scale_factor=2, mode="nearest"),
                                       F.interpolate(h, size=(11, 5), mode="nearest")),
    "upsample_bilinear": lambda h: _cat(
        F.interpolate(h, size=(11, 5), mode="bilinear", align_corners=True),
        F.interpolate(h, scale_factor=0.5, mode="bilinear"),
    ),
    # torch's decompositions reduce with `prims.prod` (products.py); `cumprod`'s backward
    # finds the zeros of each row with `max` of a boolean (`lowerings.boolean_maximum`)
    "products": lambda h: _cat(torch.prod(h.tanh(), 1), torch.cumprod(torch.relu(h), -1),
                               torch.cumprod(1 - torch.sigmoid(h), 2)),
    # pairs as complex numbers, polar: angle's backward compares complex numbers with zero
    # (`complex_pairs._equal`)
    "complex_polar": lambda h: _cat(
        torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2)).angle(),
        torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2)).abs()),
    "complex_assigned": _complex_assigned,
    # A complex tensor padded (its pairs' dimension stays 2: complex_pairs._padded).
    "complex_padded": lambda h: torch.view_as_real(F.pad(
        torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2)), (1, 2))).flatten(1),
    "accumulated": _accumulated,
    "einsum": lambda h: _cat(torch.einsum("bchw,bdhw->bcd", h, h), torch.einsum("bcii->bci", h)),
    "max_min_reductions": _max_min_reductions,
    "group_norm": torch.nn.GroupNorm(2, 4),
    "cross_entropy_label_smoothing": lambda h: F.cross_entropy(
        h.mean((2, 3)), torch.tensor([0, 3, 1]), label_smoothing=0.1
    ),
    "cross_entropy_ignore_index": lambda h: F.cross_entropy(
        h.flatten(2), torch.tensor([[0, -100] * 32, [1, 2] * 32, [-100, 3] * 32])
    ) + F.cross_entropy(
        h.flatten(2), torch.tensor([[0, 2] * 32, [1, 2] * 32, [2, 3] * 32]), ignore_index=2,
        label_smoothing=0.2, weight=torch.tensor([1.0, 2.0, 3.0, 4.0]),
    ),
}


class ConvThen(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.op = op

    def forward(self, x):
        return self.op(self.conv(x))


class TransposedConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        self.grouped_up = torch.nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2)

    def forward(self, x):
        return self.grouped_up(torch.relu(self.up(x)))


class WeightNormed(torch.nn.Module):
    """weight_norm as a parametrization: dim 0 takes torch's fused kernel, whose backward has
    no ONNX translation (traced unfused, `private.plain_weight_norm`); dim 1 does not."""

    def __init__(self) -> None:
        super().__init__()
        normed = torch.nn.utils.parametrizations.weight_norm
        self.conv = normed(torch.nn.Conv2d(3, 4, 3, padding=1))
        self.mix = normed(torch.nn.Conv2d(4, 4, 1), dim=1)

    def forward(self, x):
        return self.mix(torch.tanh(self.conv(x)))


class Pooled3d(torch.nn.Module):
    """3-D pooling (video CNNs): max and average pooling's backward ops have no translation,
    lowered (`lowerings.py`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(x.view(*x.shape[:2], 4, 4, 4))
        return _cat(F.max_pool3d(h, 2), F.max_pool3d(h, 3, stride=2, padding=1, ceil_mode=True),
                    F.avg_pool3d(h, 3, stride=2, padding=1, count_include_pad=False),
                    F.avg_pool3d(h, (2, 3, 3), stride=2, padding=1, ceil_mode=True),
                    F.adaptive_avg_pool3d(h, 1))


class Bags(torch.nn.Module):
    """EmbeddingBag's fused op has no translated backward: traced as what it computes
    (`lowerings.embedding_bag`). Sums with per-sample weights that need a gradient and an empty
    bag; means with padding_idx, of a 2-D input."""

    def __init__(self) -> None:
        super().__init__()
        self.sums = torch.nn.EmbeddingBag(20, 4, mode="sum")
        self.means = torch.nn.EmbeddingBag(20, 4, mode="mean", padding_idx=0)
        self.sharpness = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        ids = (x.abs() * 10).long() % 20
        weights = torch.sigmoid(self.sharpness * x.flatten())
        sums = self.sums(ids.flatten(), torch.tensor([0, 0, 50]), per_sample_weights=weights)
        return _cat(sums, self.means(ids.flatten(1)))


class SpectralNormed(torch.nn.Module):
    """spectral_norm's power iteration computes `W.T @ u` (and every `mv`'s backward reads a
    transposed matrix times a vector), which ONNX Runtime's Transpose-MatMul fusion computed
    wrong: lowered to a matrix product (`lowerings.matrix_vector`). Its buffers are updated as
    in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Conv2d(3, 4, 3))
        self.direction = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.conv(x)
        return _cat(h, torch.mv(h.mean((2, 3)), self.direction)[:, None])


class FourierLayer(torch.nn.Module):
    """A Fourier neural operator's spectral layer: the lowest modes of a 2-D FFT mixed by a
    complex parameter (`einsum`: a complex batched matmul), written into a tensor of zeros, and
    the FFT's magnitude. torchlib translates no `unsqueeze`, `expand`, `where`, `bmm`,
    `new_zeros`, `slice_scatter` of complex tensors, which these meet: written on their real
    representation (`complex_pairs.py`); the layer ran eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = torch.nn.Conv2d(3, 4, 1)
        self.modes = torch.nn.Parameter(torch.randn(4, 4, 3, 3, dtype=torch.cfloat) / 16)

    def forward(self, x):
        h = self.lift(x)
        spectrum = torch.fft.rfft2(h)
        mixed = torch.zeros_like(spectrum)
        mixed[..., :3, :3] = torch.einsum("bixy,ioxy->boxy", spectrum[..., :3, :3], self.modes)
        return _cat(torch.fft.irfft2(mixed, s=h.shape[-2:]), spectrum.abs())


class Biaffine(torch.nn.Module):
    """`nn.Bilinear` (a biaffine scorer): its kernel, `_trilinear`, has no ONNX translation,
    nor has its backward; traced as the contraction it computes (`lowerings.bilinear`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.score = torch.nn.Bilinear(8, 8, 5)
        self.unbiased = torch.nn.Bilinear(8, 8, 2, bias=False)

    def forward(self, x):
        h = self.conv(x)
        return _cat(self.score(h, h.flip(-1).tanh()), self.unbiased(h.mean(1), h.amax(1)))


MODELS = {"transposed_convolution": TransposedConv, "weight_norm": WeightNormed,
          "pooling_3d": Pooled3d, "embedding_bag": Bags, "spectral_norm": SpectralNormed,
          "fourier_layer": FourierLayer, "bilinear": Biaffine}


def _model(name: str) -> torch.nn.Module:
    if name in MODELS:
        return MODELS[name]()
    op = OPS[name]  # a function, or a module (with parameters) built afresh for each test
    return ConvThen(copy.deepcopy(op) if isinstance(op, torch.nn.Module) else op)


@pytest.mark.parametrize("name", [*OPS, *MODELS])
def test_op_runs_through_ort_with_eagers_outputs_and_gradients(name):
    torch.manual_seed(0)
    eager = _model(name)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(3, 3, 8, 8)
    for step in range(2):  # the first step runs eagerly and builds; the second runs in ORT
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        out, expected = lazy(x), eager(x)
        cotangent = torch.randn_like(expected)
        (out * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        assert_close(out.detach(), expected.detach(), f"{name} step {step} output")
        assert_grads_equal(lazy, eager, f"{name} step {step}")
        for (buffer, got), want in zip(lazy.named_buffers(), eager.buffers()):
            assert_close(got, want, f"{name} step {step} {buffer}")
    assert ran_through_ort([out])
    assert lazygrad.stats(lazy).fallbacks == 0


def test_a_fourier_layer_trains_through_ort_as_its_sizes_change():
    """From the first call that changes a size, the sizes are symbols: the size of a complex
    tensor (read on its real representation), complex zeros and paddings of symbolic sizes
    did not export, and the error blamed the first op the exporter's registry lacks (the
    model's convolution, whose every instance then ran eagerly)."""
    torch.manual_seed(0)
    eager = FourierLayer()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, (batch, size) in enumerate([(3, 8), (3, 8), (4, 10), (4, 10), (2, 12)]):
        squares_step_like_eager(lazy, eager, (torch.randn(batch, 3, size, size),),
                                f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks, stats.breaks) == (2, 3, 0, 0)


class SpatialTransformer(torch.nn.Module):
    """Its affine transform predicted from the input, its grid of the input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.locate = torch.nn.Linear(192, 6)
        self.head = torch.nn.Linear(192, 3)

    def forward(self, x):
        theta = self.locate(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)
        return self.head(F.grid_sample(x, grid, align_corners=False).flatten(1))


def test_a_spatial_transformer_is_served_by_one_graph_as_its_batch_changes():
    """`affine_grid` of the input's size: its op's own kernel took exact sizes only, so the
    trace with the batch a symbol failed, and each batch size was traced and built anew."""
    torch.manual_seed(0)
    eager = SpatialTransformer()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    # (Over 3: the decomposition's trace assumes a batch unequal to a grid point's 3 values.)
    for step, batch in enumerate([4, 4, 6, 6, 5]):
        squares_step_like_eager(lazy, eager, (torch.randn(batch, 3, 8, 8),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks, stats.breaks) == (2, 3, 0, 0)


class PrototypeDistances(torch.nn.Module):
    """A prototypical network's head: each query's L1 and euclidean distances to 5 learned
    prototypes, as logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.prototypes = torch.nn.Parameter(torch.randn(5, 8))

    def forward(self, x):
        queries = self.embed(x)
        return -(torch.cdist(queries, self.prototypes) + torch.cdist(queries, self.prototypes, 1))


def test_a_prototypical_network_runs_whole_through_ort_as_its_episode_size_changes():
    torch.manual_seed(0)
    eager = PrototypeDistances()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, queries in enumerate([10, 10, 15, 15, 20]):
        squares_step_like_eager(lazy, eager, (torch.randn(queries, 6),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.hits, stats.fallbacks, stats.breaks) == (2, 3, 0, 0)


def test_a_cdist_whose_differences_would_be_large_is_left_to_its_fused_op(monkeypatch):
    """Its differences would exceed `DIFFERENCES_AT_MOST` elements (4 MiB), which the fused op
    never makes: the op stays as torch computes it, and the model runs in parts with eager's
    gradients, the op named."""
    monkeypatch.setattr(lowerings, "DIFFERENCES_AT_MOST", 10 * 5 * 8 - 1)
    torch.manual_seed(0)
    eager = PrototypeDistances()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(2):
            squares_step_like_eager(lazy, eager, (torch.randn(10, 6),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 1)
    assert "_cdist_forward" in stats.reasons[0]


# ---------------------------------------------------------------------------------------------
# Failures surface at build time


@torch.library.custom_op("lazygrad_test::scaled_erf", mutates_args=())
def scaled_erf(x: torch.Tensor) -> torch.Tensor:
    """An op of the user's own: the exporter knows no translation for it."""
    return 2 * torch.erf(x)


@scaled_erf.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_erf_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * (4 / math.sqrt(math.pi)) * torch.exp(-x * x)


scaled_erf.register_autograd(
    _scaled_erf_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)


def _erf_in_double(x):
    """A valid ONNX translation that stock ORT cannot run: its CPU provider has no Erf kernel
    for double, so creating the session fails."""
    from onnxscript import opset18 as op

    return op.CastLike(op.Erf(op.Cast(x, to=onnx.TensorProto.DOUBLE)), x) * op.CastLike(2.0, x)


class ErfHead(torch.nn.Module):
    """No submodules: a failure leaves nothing to run in parts (tests/test_graph_breaks.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Parameter(0.5 * torch.randn(5, 5))
        self.head = torch.nn.Parameter(0.5 * torch.randn(2, 5))

    def forward(self, x):
        return scaled_erf(x @ self.inner.T) @ self.head.T


@pytest.fixture
def erf_translated_for_ort_it_cannot_run(monkeypatch):
    """The exporter's registry, for this test only, translates scaled_erf into Erf of doubles."""
    registry = onnx_registry()
    monkeypatch.setattr(registry, "functions", dict(registry.functions))
    registry.register_op(torch.ops.lazygrad_test.scaled_erf.default, _erf_in_double)


@pytest.mark.falls_back
@pytest.mark.parametrize("failure", ["export", "session"])
def test_untranslatable_op_or_unloadable_graph_falls_back_at_the_first_backward(failure, request,
                                                                                monkeypatch):
    """The build at the first backward exports both graphs and creates (and runs) both ORT
    sessions, so either failure is a fallback there: one warning naming the reason, raised
    before any later step starts, and no later step runs anything in ORT or raises."""
    if failure == "session":
        request.getfixturevalue("erf_translated_for_ort_it_cannot_run")
    ort_runs = []
    run = GraphSession.run
    monkeypatch.setattr(GraphSession, "run",
                        lambda self, feeds: ort_runs.append(1) or run(self, feeds))
    torch.manual_seed(0)
    eager = ErfHead()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        x = torch.randn(4, 5)
        ort_runs.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", lazygrad.FallbackWarning)
            out, expected = lazy(x), eager(x)
            out.square().sum().backward()
            expected.square().sum().backward()
        reasons = [str(w.message) for w in caught
                   if issubclass(w.category, lazygrad.FallbackWarning)]
        if step == 0:  # the build ran at this backward, and failed there
            assert len(reasons) == 1, reasons
            wanted = ("no ONNX translation", "lazygrad_test.scaled_erf") if failure == "export" \
                else ("ORT cannot load", "Erf")
            assert all(part in reasons[0] for part in wanted), reasons[0]
        else:
            assert reasons == [], f"step {step}"
            assert not ran_through_ort([out]), f"step {step}"
            assert ort_runs == [], f"step {step}: ORT ran"
        assert_close(out.detach(), expected.detach(), f"step {step} output")
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.builds, stats.hits) == (1, 0, 0)


class Recurrent(torch.nn.Module):
    """LSTM and GRU over raw features (an input that needs no gradient: torch's LSTM
    decomposition would take its mkldnn op, which ONNX cannot express)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(5, 6, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = torch.nn.GRU(5, 4, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.cat([self.lstm(x)[0], self.gru(x)[0]], -1)[:, -1])


def test_lstm_and_gru_over_raw_features_run_through_ort_and_stay_usable_afterwards():
    torch.manual_seed(0)
    eager = Recurrent()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x = torch.randn(3, 7, 5)
    for step in range(3):
        got = sum_step_like_eager(lazy, eager, (x,), f"step {step}")
    assert ran_through_ort([got])
    # The trace left the module as it was: an RNN's own list of its weights holds them still
    # (it held the trace's tensors, and the next new signature failed on them).
    for rnn in (lazy.lstm, lazy.gru):
        assert all(type(w) is torch.nn.Parameter for w in rnn._flat_weights)
    with torch.no_grad():
        assert_close(lazy(x), eager(x), "an inference call after training")
    assert lazygrad.stats(lazy).fallbacks == 0


def test_a_gradient_that_comes_through_a_transpose_is_checked_and_served():
    torch.manual_seed(0)
    eager = torch.nn.Linear(8, 8)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x, w = torch.randn(2, 5, 8), torch.randn(2, 8, 5)
    for step in range(3):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
            (model(x).transpose(1, 2) * w).sum().backward()  # a non-contiguous cotangent
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_attention_finds_its_fully_masked_rows_with_one_reduction():
    """SDPA's math path (`_safe_softmax`) compared every score with -inf, cast twice, reduced
    and selected against an expanded zero tensor: six passes over each layer's scores. The
    graph now reduces each row to its maximum once."""
    torch.manual_seed(0)
    eager = Attention()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        sum_step_like_eager(lazy, eager, (torch.randn(2, 5, 16),), f"step {step}")
    assert lazygrad.stats(lazy).hits == 2 and lazygrad.stats(lazy).fallbacks == 0
    (entry,) = attach.installed(lazy)._pairs.values()
    ops = [node.op_type for node in entry.pair.graphs.forward.graph.node]
    assert "ReduceMin" not in ops and ops.count("Cast") <= 1, ops  # torch's: ReduceMin, 3 Casts
    assert "ReduceMax" in ops or "aten_amax" in ops  # torchlib's amax, a function ORT inlines


class UnsortedRouter(torch.nn.Module):
    """Picks 3 of 8 experts with `topk(sorted=False)` (DeepSeek-V3's router), whose order eager's
    CPU kernel chooses (an introselect's) and ORT's TopK does not reproduce: traced as the
    sorted top-k, its picks rotated by the build's check, which finds nothing the graphs
    return depends on their order (`open_order.py`; where something does, the check refuses
    the graphs: `test_random_ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 8)
        self.experts = torch.nn.Linear(16, 8 * 4)

    def forward(self, x):
        scores = self.gate(x).sigmoid()
        weights, chosen = torch.topk(scores, 3, dim=-1, sorted=False)
        dense = torch.zeros_like(scores).scatter(-1, chosen, weights / weights.sum(-1, True))
        return (self.experts(x).view(-1, 8, 4) * dense[..., None]).sum(1)


class NumberFirst(torch.nn.Module):
    """`torch.add(0.3333, mask, alpha=0.6667)`, as PhiMoE's router scales its gradient. Traced,
    the number stays a number in the op's Tensor argument, for which the exporter found no
    overload: PhiMoE ran in parts. It is exported as a 0-d tensor constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.linear(x)
        return h * torch.add(0.3333, h > 0, alpha=0.6667).type_as(h) + torch.sub(1, h, alpha=2)


class ComplexRotary(torch.nn.Module):
    """Rotary embeddings as Meta's reference Llama writes them: pairs of features viewed as
    complex numbers, turned by a complex buffer (`freqs_cis`), and the product of two complex
    tensors, which the backward reads. ONNX holds complex tensors as real ones with a trailing
    dimension of 2 (the exporter's representation): lazygrad's sessions refused the complex
    buffer and stash, and the model ran in parts."""

    def __init__(self) -> None:
        super().__init__()
        self.query = torch.nn.Linear(16, 16)
        self.key = torch.nn.Linear(16, 16)
        angles = torch.outer(torch.arange(16.0), 1.0 / 100 ** (torch.arange(8.0) / 8))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        rotated = []
        for project in (self.query, self.key):
            pairs = torch.view_as_complex(project(x).view(4, 16, 8, 2))
            rotated.append(pairs * self.freqs_cis)
        return torch.view_as_real(rotated[0] * rotated[1].conj()).flatten(1)


class TimeMixing(torch.nn.Module):
    """A Linear across time steps (a transposed input: a matmul and a bias added after it), a
    GELU reading the sum: the backward reads the sum, whose node the forward's rewrite into one
    `addmm` (`head.py`) replaced under another name; the backward's link to it was lost, and
    PatchTSMixer ran in parts ("KeyError: 'add'")."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = F.gelu(self.mix(x.view(4, 16, 16).transpose(1, 2)))
        return self.out(h.transpose(1, 2)).flatten(0, 1)


class ImageTokens(torch.nn.Module):
    """Image features written into the text embeddings at the image tokens' places by
    `masked_scatter`, as LLaVA and other vision-language models merge them: the projector is
    trained through the op's backward, which has no ONNX translation (`lowerings.
    masked_scatter_backward`); LLaVA ran in parts."""

    def __init__(self) -> None:
        super().__init__()
        self.text = torch.nn.Linear(16, 16)
        self.projector = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
                                             torch.nn.Linear(16, 16))
        image_tokens = torch.zeros(4, 16, 1, dtype=torch.bool)
        image_tokens[:, 2:5] = True
        self.register_buffer("image_tokens", image_tokens)

    def forward(self, x):
        embeddings = self.text(x).view(4, 16, 16)
        features = self.projector(x[:12])
        merged = embeddings.masked_scatter(self.image_tokens.expand_as(embeddings), features)
        return merged.flatten(0, 1)


@pytest.mark.parametrize("model", [UnsortedRouter, NumberFirst, ComplexRotary, TimeMixing,
                                   ImageTokens])
def test_a_model_whose_trace_ort_or_the_exporter_took_otherwise_runs_through_ort(model):
    torch.manual_seed(0)
    eager = model()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        sum_step_like_eager(lazy, eager, (torch.randn(64, 16),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0, stats.reasons


class Float64Numbers(torch.nn.Module):
    """A float64 model whose ops take numbers: BatchNorm's `1/N` and epsilon, clamp's bounds,
    `add`'s alpha, LeakyReLU's and ELU's coefficients (float32 attributes of their ONNX ops),
    LayerNorm and GroupNorm (whose translations type their statistics as float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.batch_norm = torch.nn.BatchNorm1d(16)
        self.layer_norm = torch.nn.LayerNorm(16)
        self.group_norm = torch.nn.GroupNorm(4, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = F.leaky_relu(self.batch_norm(self.linear(x)), 0.1)
        h = torch.add(F.elu(self.layer_norm(h), 0.7), h.clamp(-0.3, 0.3), alpha=0.3)
        return self.head(self.group_norm(h))


def test_a_float64_model_runs_through_ort_to_float64_precision():
    """Its numbers were float32 constants in the exported graphs: BatchNorm's input gradient
    1e-9 off where eager's is 1e-16 off, and LayerNorm's graph did not load (the model ran
    in parts)."""
    torch.manual_seed(0)
    eager = Float64Numbers().double()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        out, expected = lazy(x), eager(x_eager)
        cotangent = torch.randn_like(expected)
        (out * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        pairs = [(out, expected), (x.grad, x_eager.grad),
                 *((p.grad, q.grad) for p, q in zip(lazy.parameters(), eager.parameters()))]
        for got, want in pairs:  # a bias before a BatchNorm: float64 noise in both
            assert got.dtype == torch.float64
            error = (got - want).abs().max().item()
            assert error <= 1e-12 * max(want.abs().max().item(), 1.0), (step, error)
    assert ran_through_ort([out])
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


def _hook_normed(norm) -> torch.nn.Module:
    """A discriminator-shaped model whose layers are normed by a pre-hook that sets their
    `weight` at every call (`torch.nn.utils.spectral_norm` also steps its power iteration's
    buffers in training)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.LeakyReLU(0.2),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 1))
    model[0], model[3] = norm(model[0]), norm(model[3])
    return model


@pytest.mark.parametrize("norm", [torch.nn.utils.spectral_norm, torch.nn.utils.weight_norm])
def test_a_norm_set_by_a_pre_hook_runs_through_ort_and_leaves_eagers_weight(norm):
    """Their `weight` is a tensor attribute each call writes: the model ran eagerly, then in
    parts with those layers (all of its parameters) eagerly. It is a result of each call now,
    written to the layer as eager writes it."""
    torch.manual_seed(0)
    eager = _hook_normed(norm)
    torch.manual_seed(0)  # the same model again: weight_norm's `weight` cannot be deep-copied
    lazy = lazygrad.lazy(_hook_normed(norm), wait_for_builds=True)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (lazy, eager)]
    for step in range(5):
        x = torch.randn(4, 3, 8, 8)
        sum_step_like_eager(lazy, eager, (x,), f"step {step}")
        for optimizer in optimizers:
            optimizer.step()
        for layer in (0, 3):
            assert_close(lazy[layer].weight.detach(), eager[layer].weight.detach(),
                         f"step {step} layer {layer} weight")
        for (name, got), want in zip(lazy.named_buffers(), eager.buffers()):
            assert_close(got, want, f"step {step} {name}")
    stats = lazygrad.stats(lazy)
    assert (stats.hits, stats.fallbacks, stats.breaks) == (2, 0, 0), stats.reasons


class WindowsOfATranspose(torch.nn.Module):
    """Overlapping windows made with `as_strided` from the strides of a transposed tensor, as
    Longformer chunks its attention: `as_strided` reads storage, which ONNX does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        t = self.linear(x).transpose(1, 2)  # (batch, 8, 12): strides (96, 1, 8)
        batch, features, length = t.shape
        windows = t.as_strided((batch, features, length // 2 - 1, 4),
                               (t.stride(0), t.stride(1), 2 * t.stride(2), t.stride(2)))
        return (windows * windows.flip(-1)).sum(-1)


def test_as_strided_of_a_transposed_tensor_reads_its_storage_through_ort():
    """The exporter's translation read the transposed tensor's values in logical order: other
    elements (the check refused the graph, and Longformer's attention ran eagerly)."""
    torch.manual_seed(0)
    eager = WindowsOfATranspose()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(3):
        out = sum_step_like_eager(lazy, eager, (torch.randn(2, 12, 8),), f"step {step}")
    assert ran_through_ort([out])
    stats = lazygrad.stats(lazy)
    assert (stats.hits, stats.fallbacks, stats.breaks) == (2, 0, 0), stats.reasons


class SmallArguments(torch.nn.Module):
    """An xIELU activation (Apertus's MLP: `expm1` of its negative part, learned slopes) on
    small pre-activations, and a `log1p` of small values: where these ops exist for."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.alpha_p = torch.nn.Parameter(torch.tensor(0.8))
        self.alpha_n = torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        h = self.linear(x) * 1e-2
        negative = (torch.expm1(h.clamp(max=-1e-6)) - h) * self.alpha_n + 0.5 * h
        activated = torch.where(h > 0, self.alpha_p * h * h + 0.5 * h, negative)
        return activated, torch.log1p(h.abs() * 1e-3)


def test_expm1_and_log1p_keep_their_precision_near_zero():
    """torchlib translates them as `exp(x) - 1` and `log(1 + x)`: near 0 each result was 1e-3
    off, within the check's tolerance (relative to the largest), and Apertus's negative-slope
    gradient 3e-4 off eager's. Each element of each result is eager's to a few roundings."""
    torch.manual_seed(0)
    eager = SmallArguments()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        x = torch.randn(64, 16)
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(x), eager(x)
        for index, (a, b) in enumerate(zip(got, want)):
            error = ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()
            assert error <= 1e-5, (step, index, error)
        sum(out.sum() for out in got).backward()
        sum(out.sum() for out in want).backward()
        for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
            error = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
            assert error <= 1e-5, (step, name, error)
    assert ran_through_ort(got)
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


class Likelihoods(torch.nn.Module):
    """The negative log-likelihoods of a time-series or count model's heads, computed in the
    model, as Hugging Face's TimeSeriesTransformer computes its Student-t loss: `lgamma` in the
    forward, `digamma` in its backward; a Beta's entropy puts `digamma` in the forward and
    `polygamma(1, x)` in the backward. None of them has an ONNX op (the model ran in parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.params = torch.nn.Linear(8, 7)

    def forward(self, x, y, counts):
        df, loc, scale, total, logits, a, b = self.params(x).unbind(-1)
        student = torch.distributions.StudentT(2 + F.softplus(df), loc, F.softplus(scale))
        counted = torch.distributions.NegativeBinomial(F.softplus(total) + 1e-3, logits=logits)
        beta = torch.distributions.Beta(F.softplus(a), F.softplus(b))
        gamma = torch.distributions.Gamma(F.softplus(a) + 0.1, F.softplus(b) + 0.1)
        return (-student.log_prob(y).mean(), -counted.log_prob(counts).mean(),
                beta.entropy().mean(), -gamma.log_prob(y.abs() + 0.1).mean(),
                torch.lgamma(counts + 1))


def test_lgamma_digamma_and_trigamma_run_through_ort_with_eagers_values():
    torch.manual_seed(0)
    eager = Likelihoods()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        x, y = 3 * torch.randn(256, 8), 4 * torch.randn(256)
        counts = torch.poisson(torch.full((256,), 5.0))
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(x, y, counts), eager(x, y, counts)
        for index, (a, b) in enumerate(zip(got, want)):
            assert_close(a.detach(), b.detach(), f"step {step}: output {index}")
        sum(out.sum() for out in got[:4]).backward()
        sum(out.sum() for out in want[:4]).backward()
        assert_grads_equal(lazy, eager, f"step {step}")
    assert ran_through_ort(got)
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats.reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_lowered_gamma_functions_are_exact_to_a_rounding(dtype):
    """Each lowering (`capture/special.py`), element by element, from -20 to 1e8, near the
    zeros and poles: within a float32 rounding of the larger of 1 and the value (float32), or
    1e-13 of it (float64: the reflection subtracts nearly equal numbers), judged by mpmath
    (which torch's sympy brings; torch's own float32 `digamma` is farther off near the negative
    integers, and its float64 `polygamma(1, x)` 1e-9 off). Where torch's kernel gives an
    infinity or NaN (the poles, the infinities, NaN), the lowering gives the same; but at the
    negative integers, where torch's `polygamma(1, x)` is a finite number from a rounded sine,
    it gives the pole's inf."""
    import mpmath

    from lazygrad.capture import special

    mpmath.mp.prec = 80
    exact_of = {"lgamma": lambda v: mpmath.log(abs(mpmath.gamma(v))),
                "digamma": lambda v: mpmath.psi(0, v),
                "trigamma": lambda v: mpmath.psi(1, v)}

    x = torch.cat([torch.linspace(-20, 20, 4001), torch.logspace(-8, 8, 161),
                   -torch.logspace(-8, 1, 91) + 0.37, -torch.logspace(-8, 1, 91),
                   torch.tensor([0.0, -0.0, 1.0, 2.0, 1.4616321, 1e30, -1e7 - 0.5,
                                 math.inf, -math.inf, math.nan])]).to(dtype)
    cases = {"lgamma": (special.lgamma, torch.lgamma),
             "digamma": (special.digamma, torch.digamma),
             "trigamma": (lambda t: special.polygamma(1, t), lambda t: torch.polygamma(1, t))}
    for name, (lowered, kernel) in cases.items():
        got, want = lowered(x), kernel(x)
        assert got.dtype == dtype, name
        if name == "trigamma":
            pole = (x <= 0) & (x == x.floor()) & x.isfinite()
            assert torch.equal(got[pole], torch.full_like(got[pole], math.inf)), name
            got, want, x = got[~pole], want[~pole], x[~pole]
        finite = torch.isfinite(want)
        assert torch.equal(got[~finite].isnan(), want[~finite].isnan()), name
        assert torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()), name
        exact = torch.tensor([float(exact_of[name](value)) for value in x[finite].tolist()],
                             dtype=torch.float64)
        error = (got[finite].double() - exact).abs() / exact.abs().clamp_min(1.0)
        assert error.max() <= (1.2e-7 if dtype == torch.float32 else 1e-13), name
    assert torch.equal(special.lgamma(torch.tensor([1.0, 2.0])), torch.zeros(2))


class MelNorm(torch.nn.Module):
    """CLAP's audio encoder's first step: BatchNorm over the mel bins of a (batch, 1, time, mel)
    input, as `batch_norm(x.transpose(1, 3))`, then a patch embedding."""

    def __init__(self, mel: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm2d(mel)
        self.patches = torch.nn.Conv2d(1, 4, 4, 4)

    def forward(self, x):
        y = self.norm(x.transpose(1, 3)).transpose(1, 3)
        return self.patches(y.permute(0, 1, 3, 2).contiguous())


def test_batch_norm_over_a_transposed_input_gets_its_true_gradient():
    """The transposed input is channels-last (its last dimension has size 1) and the output's
    gradient arrives contiguous: torch 2.13's CPU kernel for that backward gives wrong
    gradients (gradcheck fails). Lazygrad traces torch's decomposition of the backward: its
    gradients are those of the same function computed in float64 from its definition (from the
    second step: the first call runs in eager PyTorch)."""
    torch.manual_seed(0)
    lazy = lazygrad.lazy(MelNorm())
    weights = torch.randn(2, 4, 2, 2)
    for step in range(3):
        x = torch.randn(2, 1, 8, 8)
        lazy.zero_grad(set_to_none=True)
        got = lazy(x)
        (got * weights).sum().backward()
        params = {n: p.detach().double().requires_grad_() for n, p in lazy.named_parameters()}
        t = x.double().transpose(1, 3)
        mean = t.mean((0, 2, 3), keepdim=True)
        var = t.var((0, 2, 3), unbiased=False, keepdim=True)
        scale = params["norm.weight"].view(1, -1, 1, 1)
        shift = params["norm.bias"].view(1, -1, 1, 1)
        y = ((t - mean) / (var + 1e-5).sqrt() * scale + shift).transpose(1, 3)
        out = F.conv2d(y.permute(0, 1, 3, 2), params["patches.weight"], params["patches.bias"], 4)
        (out * weights.double()).sum().backward()
        assert_close(got.detach().double(), out.detach(), f"step {step}: output")
        for name, p in lazy.named_parameters():
            if step > 0:
                assert_close(p.grad.double(), params[name].grad, f"step {step}: {name}.grad")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0


def test_relu6_and_clamp_at_their_bounds_pass_no_gradient_as_eager():
    """`hardtanh_backward` (ReLU6, `clamp` by numbers) gives no gradient where the input equals
    a bound, as torch's kernel does; torchlib's translation let it through there, so a step
    whose activations hit 0 or 6 exactly got other gradients (the check caught the first
    step's and fell back; a later step's would not have been checked)."""

    class Bounded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scaled = x * self.scale
            return F.relu6(scaled) + F.hardtanh(scaled, -1.0, 3.0)

    eager = Bounded()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.tensor([-1.0, 0.0, 3.0, 6.0, 7.0, 2.0])  # on both bounds of both
    for step in range(3):
        got = sum_step_like_eager(lazy, eager, (x * (1 + step),), f"step {step}")
    assert ran_through_ort([got])
    assert torch.equal(lazy.scale.grad, eager.scale.grad)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2, stats.reasons


class SpecialValues(torch.nn.Module):
    """An op of `SPECIAL_VALUE_OPS` of (y, x), y scaled by a parameter."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = SPECIAL_VALUE_OPS[op]
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.op(y * self.scale, x)


# Ops whose translations differed from eager at zeros, infinities or NaN (lowerings.py):
SPECIAL_VALUE_OPS = {
    # the quadrant from `y > 0`, NaN mapped to 0: (0, -1) got -pi (eager pi), two zeros 0
    "atan2": torch.atan2,
    # log(exp(a) + exp(b)): logaddexp(0, 100) infinite (eager 100)
    "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2,
    # ORT's Clip without a bound: an infinity became 3.4e38
    "clamp_min": lambda y, x: y.clamp_min(0.5) + y.clamp(max=x),
    "clamp_max": lambda y, x: y.clamp_max(-0.5) + torch.clamp(y, min=x),
    # ONNX's Sign of NaN is NaN, eager's 0
    "sign": lambda y, x: y.sign() * x + torch.sgn(y),
    # no translation (signbit, prims): the module ran in parts. Not tested: the sign bit of a
    # NaN (ONNX cannot read it: signbit(-nan) is False), the sign of a zero that fmax or fmin
    # picks between 0.0 and -0.0 (ORT's Max's choice; `+ 0` makes both 0.0)
    "copysign": lambda y, x: torch.copysign(y, x.nan_to_num()) + torch.copysign(y, -2.0),
    "signbit": lambda y, x: y * torch.signbit(x.nan_to_num()),
    "fmax": lambda y, x: torch.fmax(y, x) + 0,
    "fmin": lambda y, x: torch.fmin(y, x) + 0,
    "hypot": torch.hypot,
}


@pytest.mark.parametrize("op", SPECIAL_VALUE_OPS)
def test_ops_give_eagers_values_at_signed_zeros_infinities_and_nan(op):
    """Built on a call of ordinary values, these ops' graphs gave later calls other values than
    eager's at special ones, silently (`lowerings.quadrant_atan2`, `stable_logaddexp`,
    `one_sided_clamp`, `sign_as_eager`). Every pair of special values: eager's results, the
    signs of zeros included, and eager's gradients (NaN where eager's are)."""
    special = [0.0, -0.0, 1.0, -1.0, 100.0, -100.0, 1e30, math.inf, -math.inf, math.nan, -3.0]
    y, x = (torch.tensor(pair) for pair in zip(*itertools.product(special, special)))
    eager = SpecialValues(op)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step, (y_now, x_now) in enumerate([(torch.randn(len(y)), torch.randn(len(y))), (y, x),
                                           (y, -x)]):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(y_now, x_now), eager(y_now, x_now)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True), f"step {step}"
        signed = (want == 0) | (want.abs() > 1e-7)  # zeros, and results beyond a rounding
        assert torch.equal(got.signbit()[signed], want.signbit()[signed]), f"step {step}"
        got.square().nan_to_num().sum().backward()
        want.square().nan_to_num().sum().backward()
        assert torch.allclose(lazy.scale.grad, eager.scale.grad, equal_nan=True), f"step {step}"
    assert ran_through_ort([got])
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2, stats.reasons


class Slices(torch.nn.Module):
    """Slices and selects of an activation, as models take them: a rotary embedding's halves,
    shifted sequences, the first and last tokens, a window past the end, an empty slice and a
    strided one."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        rotated = torch.cat((-h[..., 4:], h[..., :4]), dim=-1)
        shifted = h[:, 1:] * h[:, :-1]
        return (h * rotated, shifted, 2 * h[:, -3:], 3 * h[:, 2:100], h[:, 0] * h[:, -1],
                4 * h[..., ::2], h[:, 5:3].sum() + (5 * h[:, -100:1]).sum())


def test_slice_and_select_gradients_are_pads_of_zeros_with_eagers_values():
    """A slice's gradient (zeros but where the slice was) was a ScatterND between Transposes that
    move the sliced dimension first (torchlib's `slice_scatter`), 13x a Pad in ORT on a rotary
    embedding's halves; a select's a ScatterElements through an index as large as the gradient.
    Both are one Pad now (`lowerings.slice_as_pad`, `select_as_pad`), over changing lengths;
    the strided slice keeps torch's decomposition."""
    torch.manual_seed(0)
    eager = Slices()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for length in (6, 6, 9, 7):
        x = torch.randn(2, length, 8)
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        got, want = lazy(x), eager(x)
        for index, (a, b) in enumerate(zip(got, want)):
            assert_close(a.detach(), b.detach(), f"length {length}: output {index}")
        sum((out * out).sum() for out in got).backward()
        sum((out * out).sum() for out in want).backward()
        assert_grads_equal(lazy, eager, f"length {length}")
    assert ran_through_ort(got)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    for entry in attach.installed(lazy)._pairs.values():
        backward = [node.op_type for node in entry.pair.graphs.backward.graph.node]
        assert backward.count("ScatterND") == 1, backward  # the strided slice's
        assert "ScatterElements" not in backward and backward.count("Pad") == 10, backward
