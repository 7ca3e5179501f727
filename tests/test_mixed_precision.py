"""Mixed precision through ORT: autocast to float16, and models in half precision.

Half-precision results differ from eager's by float16's rounding (one ulp is 1e-3 of a value),
not float32's, so each step is judged as torch's own accuracy checks judge compiled code:
against the same model run in float64, lazygrad's error within a small factor of eager's own.
The outputs are eager's within float16's rounding, of eager's dtypes.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from conftest import cuda_usable
from torch import nn

import lazygrad
from lazygrad.examples.models import BertConfig, BertPretraining, MoELayer, bert_batch

HALF_ULP = 1e-3  # float16's spacing at 1, relative
AS_EAGER = 3.0  # lazygrad's float64 error within this factor of eager's


class NormsNet(nn.Module):
    """Each normalization torch has, after convolutions: group, instance (with and without
    affine parameters: batch norm without running statistics underneath), batch; and ReLU6,
    whose backward's translation typed its masks float32."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.group = nn.GroupNorm(2, 8)
        self.instance = nn.InstanceNorm2d(8, affine=True)
        self.batch = nn.BatchNorm2d(8)
        self.bare = nn.InstanceNorm2d(8)
        self.layer = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bare(self.batch(self.instance(self.group(self.conv(x)))))
        return self.head(self.layer(nn.functional.relu6(h).mean((2, 3))))


class PositionBias(nn.Module):
    """Attention scores plus a learned bias looked up by relative position (Swin's, T5's):
    the table's gradient adds the rows each position picked, repeated positions included."""

    def __init__(self, tokens: int = 6, heads: int = 2) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8 * heads)
        self.table = nn.Parameter(torch.randn(2 * tokens - 1, heads))
        positions = torch.arange(tokens)
        self.register_buffer("index", (positions[:, None] - positions[None, :] + tokens - 1))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query(x).unflatten(-1, (self.heads, 8)).transpose(1, 2)
        scores = q @ q.transpose(-1, -2) / 8
        bias = self.table[self.index.reshape(-1)].reshape(*self.index.shape, -1)
        return (scores + bias.permute(2, 0, 1)).softmax(-1)


def _bert():
    torch.manual_seed(0)
    config = BertConfig()
    return BertPretraining(config), bert_batch(config), lambda out: out[0]


def _moe():
    torch.manual_seed(0)
    return MoELayer(), (torch.randn(8, 16),), lambda out: out[0].float().square().mean() + out[1]


def _norms():
    torch.manual_seed(0)
    weights = torch.randn(4, 4)
    return NormsNet(), (torch.randn(4, 3, 8, 8),), lambda out: (out.float() * weights).sum()


def _position_bias():
    torch.manual_seed(0)
    weights = torch.randn(4, 2, 6, 6)
    return PositionBias(), (torch.randn(4, 6, 8),), lambda out: (out.float() * weights).sum()


def _flat(outputs) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


def _error(tensors: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Relative error of all the tensors together (their norm's), against float64 ones."""
    got = torch.cat([t.double().cpu().flatten() for t in tensors])
    want = torch.cat([t.detach().flatten() for t in reference])
    return ((got - want).norm() / want.norm()).item()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _trains_as_eager(make, mode: str, dtype: torch.dtype, device: str) -> None:
    """Three steps under autocast to `dtype` (float32 parameters, products in `dtype`), or with
    the model in `dtype` ("half"): outputs of eager's dtypes, outputs and gradients as close to
    the model's in float64 as eager's own, served by ORT."""
    model, inputs, loss = make()
    reference = copy.deepcopy(model).double()
    wide_inputs = [x.double() if x.is_floating_point() else x for x in inputs]
    model, inputs = model.to(device), [x.to(device) for x in inputs]
    if mode == "half":
        model = model.to(dtype)
        inputs = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    eager = copy.deepcopy(model)
    lazy = lazygrad.lazy(copy.deepcopy(model))
    context = (lambda: torch.autocast(device, dtype=dtype)) if mode == "autocast" \
        else contextlib.nullcontext
    for step in range(3):
        for module in (lazy, eager, reference):
            module.zero_grad(set_to_none=True)
        with context():
            got, want = lazy(*inputs), eager(*inputs)
        exact = reference(*wide_inputs)
        for index, (a, b, c) in enumerate(zip(_flat(got), _flat(want), _flat(exact))):
            assert a.dtype == b.dtype, f"step {step} output {index}: {a.dtype} != {b.dtype}"
            lazy_error, eager_error = _error([a.detach()], [c]), _error([b.detach()], [c])
            assert lazy_error <= AS_EAGER * eager_error + 1e-6, (
                f"step {step} output {index}: float64 error {lazy_error:.2e} against eager's "
                f"{eager_error:.2e}")
        loss(got).backward()
        loss(want).backward()
        loss(exact).backward()
        eager_error = _error(_grads(eager), _grads(reference))
        lazy_error = _error(_grads(lazy), _grads(reference))
        assert [g is None for g in _grads(lazy)] == [g is None for g in _grads(eager)]
        assert lazy_error <= AS_EAGER * eager_error + 1e-6, (
            f"step {step}: float64 error {lazy_error:.2e} against eager's {eager_error:.2e}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits >= 2, stats


MODELS = pytest.mark.parametrize("make", [_bert, _moe, _norms, _position_bias],
                                 ids=["bert", "moe", "norms", "position bias"])
MODES = pytest.mark.parametrize("mode", ["autocast", "half"])


@MODELS
@MODES
def test_float16_trains_through_ort_as_eager_does(make, mode):
    """On the CPU (layer norm, instance norm and ReLU6 graphs mixed float32 and float16 in one
    ONNX op and did not load; a float16 sum returned as an output came back float32; ORT's CPU
    has no float16 scatter-add, the position-bias table's gradient)."""
    _trains_as_eager(make, mode, torch.float16, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_usable(), reason="needs CUDA and onnxruntime's CUDA provider")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@MODELS
@MODES
def test_half_precision_trains_through_ort_on_cuda(make, mode, dtype):
    """On CUDA, both half types (the normalizations' statistics float32, as eager's CUDA
    kernels give them)."""
    _trains_as_eager(make, mode, dtype, "cuda")


def test_a_float16_training_loop_with_grad_scaler_matches_eager():
    """The usual mixed-precision loop (autocast, `GradScaler` scaling the loss and unscaling the
    gradients before AdamW's step): the parameters after five steps are eager's, to float16's
    rounding of the products, and every step after the first ran through ORT."""
    model, inputs, loss = _bert()
    eager, lazy = copy.deepcopy(model), lazygrad.lazy(copy.deepcopy(model))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (lazy, eager)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    for _ in range(5):
        for module, optimizer, scaler in zip((lazy, eager), optimizers, scalers):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                value = loss(module(*inputs))
            scaler.scale(value).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        difference = (p - q).abs().max().item()
        assert difference <= 10 * HALF_ULP * max(q.abs().max().item(), 1.0), name
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 4, stats


def test_bfloat16_on_cpu_falls_back_whole_with_the_reason():
    """ORT's CPU provider has no bfloat16 kernels (MatMul, Add): the model runs in eager
    PyTorch, one warning naming that, every step eager's exactly."""
    model, inputs, loss = _bert()
    eager, lazy = copy.deepcopy(model).bfloat16(), lazygrad.lazy(copy.deepcopy(model).bfloat16())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got, want = lazy(*inputs), eager(*inputs)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            loss(got).backward()
            loss(want).backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, lazygrad.FallbackWarning)]
    assert len(messages) == 1 and "no bfloat16 kernels" in messages[0], messages
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(lazy.parameters(), eager.parameters()))
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 1 and stats.hits == 0


@pytest.mark.parametrize("allowed", [False, True])
def test_cuda_sessions_use_tf32_exactly_where_torchs_matmuls_do(monkeypatch, allowed):
    """ORT's CUDA provider multiplies float32 matrices in TF32 by default (Ampere and later);
    torch does so only where the user allows it. The provider is told torch's setting."""
    from lazygrad import session

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allowed)
    assert session.tf32_option() == ("1" if allowed else "0")
