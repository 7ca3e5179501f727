"""Graph breaks at module granularity: a module that cannot be captured whole runs its own
forward in eager PyTorch and its submodules through ORT, each with its own signatures, grad
masks and statistics; each step against eager PyTorch (outputs, gradients, `.grad is None`)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_close, assert_grads_equal, squares_step_like_eager
from test_capture import LoopRoutedMoE, _routed_tokens, _step

import lazygrad
from lazygrad.capture import CaptureError

pytestmark = pytest.mark.falls_back  # every test here breaks a module on purpose


def _warnings_of(caught, category) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def test_routing_over_nonzero_runs_router_and_experts_through_ort_and_never_bakes_routes():
    """The routes (`unique().tolist()`, `nonzero`) are the first call's in its graph, and
    checked: each call routed otherwise runs in eager PyTorch, and after 4 such calls the MoE
    runs in parts, its loop eagerly, its router and experts through ORT."""
    torch.manual_seed(0)
    eager = LoopRoutedMoE()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    routes = [[0, 1, 0, 1, 0, 1], [2, 3, 3, 2, 2, 3], [0, 3, 1, 2, 3, 0], [1, 0, 0, 1, 1, 0]] * 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, route in enumerate(routes):
            x = _routed_tokens(route, seed=step)
            with torch.no_grad():
                assert eager.router(x).argmax(-1).tolist() == route  # the routing differs
            _step(lazy, eager, (x,), lambda o: o.square().sum(), f"step {step} route {route}")
    breaks = _warnings_of(caught, lazygrad.GraphBreakWarning)
    assert len(breaks) == 1 and "the checks its graph makes on tensor values" in breaks[0] \
        and "failed in 4 of" in breaks[0], breaks
    assert _warnings_of(caught, lazygrad.FallbackWarning) == breaks  # nothing else fell back
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0 and stats.exports == 1
    assert set(stats.parts) == {"router", "experts.0", "experts.1", "experts.2", "experts.3"}
    for name, part in stats.parts.items():
        assert part.fallbacks == 0 and part.breaks == 0, name
        assert part.hits > 0, f"{name} never ran through ORT"
    assert stats.parts["router"].exports == 1  # six tokens every step: one signature
    assert stats.step_seconds > 0 and 0 < stats.ort_seconds < stats.step_seconds
    assert "inside ONNX Runtime" in str(stats) and "experts.3" in str(stats)


@torch.library.custom_op("lazygrad_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    """An op with a fake and an autograd registration but no ONNX translation."""
    return x * 2.0


@_scaled.register_fake
def _(x):
    return torch.empty_like(x)


def _scaled_backward(ctx, grad):
    return grad * 2.0


_scaled.register_autograd(_scaled_backward)


class Untranslatable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _scaled(self.proj(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.odd = Untranslatable()
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.out(torch.relu(self.odd(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h), h.mean()


def test_an_untranslatable_op_breaks_straight_to_every_submodule_of_its_class():
    """The failure names the submodule whose code emitted the op: every module of that class
    runs its own code eagerly (its Linear through ORT) and the modules holding one run in parts
    at once, with no capture of their own that would fail again; everything else runs through
    ORT."""
    torch.manual_seed(0)
    eager = Stack()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(5, 4)
    losses = [lambda o: o[0].square().sum(), lambda o: o[0].sum() + o[1]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            _step(lazy, eager, (x,), losses[step % 3 == 2], f"step {step}")
    breaks = _warnings_of(caught, lazygrad.GraphBreakWarning)
    assert len(_warnings_of(caught, lazygrad.FallbackWarning)) == 1 and len(breaks) == 1
    assert sum(part.fallbacks for part in lazygrad.stats(lazy).parts.values()) == 0
    assert "lazygrad_test.scaled" in breaks[0] and "blocks.0.odd" in breaks[0], breaks
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1
    for name in ("blocks.0", "blocks.1"):
        assert stats.parts[name].breaks == 1 and stats.parts[name].builds == 0, name
        assert stats.parts[f"{name}.odd"].breaks == 1, name
        assert stats.parts[f"{name}.odd"].builds == 0, name  # no capture to fail again
        assert "lazygrad_test.scaled" in stats.parts[f"{name}.odd"].reasons[0]
    for name in ("embed", "head", "blocks.0.norm", "blocks.0.out", "blocks.1.out",
                 "blocks.1.odd.proj"):
        assert stats.parts[name].hits > 0 and stats.parts[name].fallbacks == 0, name
    assert stats.parts["head"].misses == 1  # one graph, not one per step


def test_strict_mode_raises_instead_of_breaking():
    lazy = lazygrad.lazy(CheckpointsABranchingBlock(), strict=True)
    with pytest.raises(lazygrad.LazygradError, match="depends on tensor values"):
        lazy(torch.randn(3, 8)).sum().backward()


class Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 2)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x)))
        return self.b(h), h.sum(-1)


def test_a_mask_whose_build_fails_at_backward_is_served_by_eager_with_the_same_draws(
        monkeypatch):
    """A new grad mask met at backward, after the forward ran in ORT, whose build fails: that
    step's gradients come from eager PyTorch (its forward redone from the saved inputs with
    the step's Dropout draws replayed), nothing raises in the middle of the step, and the
    signature runs in parts from then on. Gradients equal eager's under the same seed."""
    import lazygrad.runtime as runtime

    real_capture = runtime.capture

    def capture_failing_for_the_second_mask(*args, **kwargs):
        module, mask = args[0], args[6]
        if isinstance(module, Noisy) and mask is not None and mask[1]:
            raise CaptureError("refused by the test")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(runtime, "capture", capture_failing_for_the_second_mask)
    torch.manual_seed(0)
    eager = Noisy()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(4, 6)
    losses = [lambda o: o[0].sum(), lambda o: o[0].sum(), lambda o: o[0].sum() + o[1].sum(),
              lambda o: o[0].square().sum(), lambda o: o[1].sum(), lambda o: o[0].sum()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, loss in enumerate(losses):
            for m in (lazy, eager):
                m.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            out = lazy(x)
            torch.manual_seed(100 + step)
            expected = eager(x)
            for got, want in zip(out, expected):
                assert_close(got.detach(), want.detach(), f"step {step} output")
            loss(out).backward()
            loss(expected).backward()
            assert_grads_equal(lazy, eager, f"step {step}")
    reasons = _warnings_of(caught, lazygrad.FallbackWarning)
    assert len(reasons) == 1 and "refused by the test" in reasons[0], reasons
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.builds == 1 and stats.eager_steps == 2  # first + redo
    assert stats.parts["a"].hits > 0 and stats.parts["b"].hits > 0


@pytest.mark.parametrize("wait", [True, False])
def test_an_inference_fast_path_a_trace_cannot_take_is_refused_not_served(wait):
    """nn.TransformerEncoder under no_grad with a padding mask runs a nested-tensor fast path
    that zeroes padded positions; its trace takes the ordinary path, which does not. The graph
    is held to eager's result on the first call, refused, and the encoder runs in parts, whose
    layers get the nested tensor and run eagerly: every call returns eager's values."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    eager = torch.nn.TransformerEncoder(layer, 1).eval()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=wait)
    x = torch.randn(2, 4, 8)
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(3):
            got, want = lazy(x, src_key_padding_mask=pad), eager(x, src_key_padding_mask=pad)
            assert torch.equal(got, want), f"call {call}"
            lazygrad.wait_for_builds(lazy)
    assert not got[1, 2:].any()  # the fast path's zeros
    assert any("does not compute what the module computes" in str(w.message) for w in caught)


def test_a_failing_submodule_condemns_only_those_of_its_class_with_its_settings():
    """BatchNorm with momentum None reads `num_batches_tracked` as a number, which the graph
    takes as the first call read it; the counter differs at every call, so each later call
    fails the graph's check, and after 4 the model breaks: that BatchNorm runs eagerly (after
    4 misses of its own), and the other BatchNorm, with its own momentum, is captured as a part
    of its own."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(  # no bias before a BatchNorm: its gradient is 0 in exact math
        torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4, momentum=None),
        torch.nn.Tanh(), torch.nn.Conv2d(4, 4, 3, bias=False), torch.nn.BatchNorm2d(4))
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    x, weights = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lazygrad.GraphBreakWarning)
        for step in range(12):
            _step(lazy, eager, (x,), lambda out: (out * weights).sum(), f"step {step}")
    for (name, got), want in zip(lazy.named_buffers(), eager.buffers()):
        assert_close(got.double(), want.double(), name)
    parts = lazygrad.stats(lazy).parts
    assert lazygrad.stats(lazy).breaks == 1 and parts["1"].hits == 0
    assert parts["4"].hits > 0 and parts["4"].fallbacks == 0


class CheckpointsABranchingBlock(torch.nn.Module):
    """Its own code compares a value read through NumPy (no trace sees it, so it runs in
    parts); its block runs checkpointed, recomputed in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                         torch.nn.Linear(16, 8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        if h.sum().detach().numpy() > 0:
            h = h * 2
        return self.head(h)


def test_a_lazy_part_inside_a_checkpointed_region_is_recomputed_as_its_forward_ran():
    """The first backward builds and finds a break, and the block becomes a lazy part; the
    checkpointed region, recomputed later in that same backward, then ran the block as a lazy
    part where its forward had run it plain, and torch's checkpoint refused the difference:
    the step crashed (DeepSeek-V3 with gradient checkpointing). The same at the part's own
    first call: eager in the forward, through ORT in the recomputation once its graphs were
    built. A region's recomputation now runs each lazy call as its forward ran it
    (`regions.py`). Every step trains as eager; the block, once built, and the head run
    through ORT."""
    torch.manual_seed(0)
    eager = CheckpointsABranchingBlock()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with pytest.warns(lazygrad.GraphBreakWarning, match="depends on tensor values"):
        for step in range(4):
            x = torch.randn(6, 8)
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
            assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.parts["head"].hits >= 2 and stats.parts["block"].hits >= 2
    assert all(part.fallbacks == 0 for part in stats.parts.values())


class InvertsItsProjection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.linalg.inv(self.linear(x) + 3 * torch.eye(3))


def test_an_op_that_orders_its_error_check_by_an_effect_token_is_named_as_the_reason():
    """`linalg.inv` checks its errors through an op with side effects, which AOTAutograd
    orders with a token it keeps itself: the token was named ("the forward keeps 1 traced
    tensor ... a hook or other user code stores them"), hiding the reason, an op without an
    ONNX translation."""
    torch.manual_seed(0)
    eager = InvertsItsProjection()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(lazy, eager, (torch.randn(2, 3, 3),), lambda o: o.sum(), f"step {step}")
    breaks = _warnings_of(caught, lazygrad.GraphBreakWarning)
    assert len(breaks) == 1 and "linalg_inv_ex" in breaks[0], breaks
    assert "keeps" not in breaks[0]
    assert lazygrad.stats(lazy).parts["linear"].hits == 1


class SparseGraphConvolution(torch.nn.Module):
    """A graph convolution over a sparse adjacency matrix, as graph networks multiply by it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 16)
        self.outer = torch.nn.Linear(16, 4)

    def forward(self, x, adjacency):
        h = torch.relu(torch.sparse.mm(adjacency, self.inner(x)))
        return torch.sparse.mm(adjacency, self.outer(h))


def test_a_sparse_argument_runs_the_modules_own_code_eagerly_and_its_layers_through_ort():
    """ONNX has no sparse tensors, so no graph takes the adjacency matrix: the whole model ran
    eagerly, and nothing said so. Now the module's own code runs eagerly, its layers through
    ORT, and the break is said once, naming the argument."""
    torch.manual_seed(0)
    edges = torch.randint(0, 10, (2, 30))
    adjacency = torch.sparse_coo_tensor(edges, torch.rand(30), (10, 10)).coalesce()
    eager = SparseGraphConvolution()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            squares_step_like_eager(lazy, eager, (torch.randn(10, 8), adjacency), f"step {step}")
    (said,) = _warnings_of(caught, lazygrad.GraphBreakWarning)
    assert "argument 1 ('adjacency')" in said and "sparse" in said
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    for name in ("inner", "outer"):
        assert stats.parts[name].hits == 2 and stats.parts[name].fallbacks == 0, name


class ScalesByItsGradient(torch.autograd.Function):
    """A backward that reads its gradient's value: no graph holds it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float(grad.abs().sum())


class ReadsItsGradient(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return ScalesByItsGradient.apply(self.linear(x)).tanh()


def test_a_backward_that_reads_a_value_is_said_once_without_torchs_anomaly_warning():
    """AOTAutograd traces the backward under anomaly mode, whose warning ("Error detected in
    ScalesByItsGradientBackward", with the forward's traceback) reached the user beside
    lazygrad's own: one warning names the reason (`capture/quiet.py`)."""
    torch.manual_seed(0)
    eager = ReadsItsGradient()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            squares_step_like_eager(lazy, eager, (torch.randn(3, 4),), f"step {step}")
    shown = [str(w.message) for w in caught]
    assert len(shown) == 1 and "depends on tensor values" in shown[0], shown
    assert "its backward" in shown[0]
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.parts["linear"].hits >= 2


class TensorOfItsValues(torch.nn.Module):
    """`torch.tensor` of a list of 0-d tensors made from data (Qwen2-VL's rope deltas)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, positions):
        deltas = torch.tensor([row.max() + 1 for row in positions])
        return torch.tanh(self.linear(x)) * deltas[:, None, None]


def test_a_tensor_of_tensors_values_is_refused_with_its_reason_not_a_crash():
    """`torch.tensor` reads each element below torch's Python dispatch, where the trace's check
    of the value read (`checks.py`) met a functional tensor bare: the process died (SIGSEGV)
    while tracing Qwen2-VL and GLM-4V."""
    torch.manual_seed(0)
    eager = TensorOfItsValues()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    positions = torch.arange(10).reshape(2, 5)
    with pytest.warns(lazygrad.GraphBreakWarning, match="`torch.tensor` of a list of tensors"):
        for step in range(3):
            squares_step_like_eager(lazy, eager, (torch.randn(2, 5, 4), positions),
                                    f"step {step}")
    assert lazygrad.stats(lazy).parts["linear"].hits >= 1


class SplitsByLengths(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, bounds):
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        return torch.cat([part.cumsum(0).tanh() for part in self.linear(x).split(lengths)])


class BoundsFromData(torch.nn.Module):
    """Reads its bounds from data (`unique_consecutive`), which its child splits by."""

    def __init__(self) -> None:
        super().__init__()
        self.before = torch.nn.Linear(4, 4)
        self.attention = SplitsByLengths()

    def forward(self, x, raw):
        return self.attention(self.before(x), torch.unique_consecutive(raw))


def test_a_child_branching_on_a_size_its_parent_read_from_data_is_captured_on_its_own():
    """The parent's trace fails inside the child, on a size the parent read: the child's class
    was held to fail alike and ran eagerly (Qwen2.5-VL's vision attention). Traced on its own,
    the size is its input's: it runs through ORT."""
    torch.manual_seed(0)
    eager = BoundsFromData()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    raw = torch.tensor([0, 4, 4, 8])
    with pytest.warns(lazygrad.GraphBreakWarning, match="depends on tensor values"):
        for step in range(4):
            squares_step_like_eager(lazy, eager, (torch.randn(8, 4), raw), f"step {step}")
    parts = lazygrad.stats(lazy).parts
    assert parts["attention"].hits >= 2 and parts["attention"].fallbacks == 0


class PacksItsSequences(torch.nn.Module):
    """Text of several lengths through an LSTM as packed sequences, and a second LSTM of the
    same settings given the padded result."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = torch.nn.LSTM(8, 8, batch_first=True)
        self.padded = torch.nn.LSTM(8, 8, batch_first=True)

    def forward(self, x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                         enforce_sorted=False)
        out, _ = self.packed(packed)
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                        total_length=x.shape[1])
        return self.padded(out)[0]


def test_an_rnn_given_a_packed_sequence_runs_eagerly_said_so_and_its_class_still_traces():
    """A packed sequence's batch sizes are data: that call runs in eager PyTorch, with that
    reason (it was a bare TypeError), and its class is not held to fail: the other LSTM, of
    the same settings, given padded tensors, runs through ORT (every LSTM ran eagerly)."""
    torch.manual_seed(0)
    eager = PacksItsSequences()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    lengths = torch.tensor([5, 3, 4])
    with pytest.warns(lazygrad.GraphBreakWarning, match="given a PackedSequence"):
        for step in range(3):
            squares_step_like_eager(lazy, eager, (torch.randn(3, 5, 8), lengths),
                                    f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and "every LSTM" not in stats.reasons[0]
    assert stats.parts["padded"].hits == 1 and stats.parts["packed"].fallbacks == 1
