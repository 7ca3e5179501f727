"""Stash policies: same gradients under each policy, recompute on a surprise, Dropout exact."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close

import lazygrad

P = 0.3


class DropoutNet(torch.nn.Module):
    """Returns the Dropout output too, so a test can read the mask that the forward drew."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(P)
        self.second = torch.nn.Linear(16, 4)
        self.side = torch.nn.Linear(16, 2)

    def forward(self, x):
        hidden = self.first(x)
        dropped = self.drop(hidden)
        return self.second(torch.tanh(dropped)), self.side(hidden), dropped, hidden


def _reference_grads(model, x, keep, cotangent_out, cotangent_side):
    """Eager gradients of the same function with the forward's Dropout mask fixed."""
    params = {n: p.detach().requires_grad_() for n, p in model.named_parameters()}
    hidden = torch.nn.functional.linear(x, params["first.weight"], params["first.bias"])
    dropped = hidden * keep / (1 - P)
    out = torch.nn.functional.linear(torch.tanh(dropped), params["second.weight"],
                                     params["second.bias"])
    side = torch.nn.functional.linear(hidden, params["side.weight"], params["side.bias"])
    loss = (out * cotangent_out).sum() + (side * cotangent_side).sum()
    loss.backward()
    return out.detach(), {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("policy", ["predict", "all", "recompute"])
def test_dropout_gradients_use_the_forward_mask_under_every_policy(policy):
    torch.manual_seed(0)
    model = lazygrad.lazy(DropoutNet(), policy=policy)
    x = torch.randn(32, 8)
    # First steps train only the side head: under "predict" the stash is planned for it, so the
    # last step's mask (which needs the Dropout branch) is a surprise that recomputes.
    for step in range(3):
        out, side, dropped, hidden = model(x)
        keep = (dropped != 0).float()
        assert 0.5 < keep.mean().item() < 0.9  # Dropout really drew a mask
        cot_out = torch.randn_like(out) if step == 2 else torch.zeros_like(out)
        cot_side = torch.randn_like(side)
        model.zero_grad(set_to_none=True)
        loss = (side * cot_side).sum() + ((out * cot_out).sum() if step == 2 else 0)
        loss.backward()
        expected_out, expected = _reference_grads(model, x, keep, cot_out, cot_side)
        assert_close(out.detach(), expected_out, "output")
        for name, p in model.named_parameters():
            if step < 2 and name.startswith("second"):
                assert p.grad is None
                continue
            assert_close(p.grad, expected[name], f"step {step} grad of {name}")
    stats = lazygrad.stats(model)
    assert stats.recomputes == (1 if policy == "predict" else 0)


def test_each_prediction_miss_recomputes_once():
    torch.manual_seed(0)
    model = lazygrad.lazy(DropoutNet())
    x = torch.randn(4, 8)
    masks = [(0, 1), (0, 1), (1, 0), (1, 0), (0, 1)]
    for which in masks:
        out, side, _, _ = model(x)
        (out.sum() if which[0] else side.sum()).backward()
    # a recompute happens exactly when the mask differs from the previous step's
    assert lazygrad.stats(model).recomputes == 2


def test_in_place_change_between_forward_and_backward_raises_pytorchs_error():
    model = lazygrad.lazy(DropoutNet())
    out, *_ = model(torch.randn(4, 8))
    with torch.no_grad():
        model.second.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    model.zero_grad()
    model(torch.randn(4, 8))[0].sum().backward()  # still usable
    assert model.second.weight.grad is not None


def _kept_bytes(outputs) -> int:
    """Bytes of the forward results a lazy step keeps for its backward (not inputs, not
    parameters, not random draws): what the grad mask decides."""
    node = outputs[0].grad_fn
    count, draws, _ = node.step._layout
    return sum(t.untyped_storage().nbytes() for t in node.saved_tensors[count + draws :])


def test_the_forward_keeps_only_what_the_backward_of_its_mask_reads():
    """NSP-only training keeps nothing of the vocabulary head; all outputs keep at least one
    logits-sized tensor of it (the log-probabilities its loss's backward reads)."""
    from conftest import MODEL_CASES

    model, inputs = MODEL_CASES["bert"]()
    kept = {}
    for mask in [(False, False, True), (True, True, True)]:
        lazy = lazygrad.lazy(copy.deepcopy(model))
        for _ in range(2):  # the first step runs eagerly
            outputs = lazy(*inputs)
            lazy.zero_grad(set_to_none=True)
            sum(o.sum() for o, bit in zip(outputs, mask) if bit).backward()
        outputs = lazy(*inputs)
        kept[mask] = _kept_bytes(outputs)
        expected = model(*inputs)
        for got, want in zip(outputs, expected):
            assert_close(got.detach(), want.detach(), f"{mask} output")
        assert lazygrad.stats(lazy).fallbacks == 0
    logits_bytes = expected[1].numel() * expected[1].element_size()
    assert kept[(True, True, True)] - kept[(False, False, True)] >= logits_bytes, kept


@pytest.mark.parametrize("policy", ["predict", "recompute"])
def test_dropout_under_a_seed_drops_what_eager_drops(policy):
    """Draws come from torch's generator, as eager's CPU Dropout makes them: under the same seed
    the lazy model's outputs and gradients are eager's, step after step, through ORT."""
    torch.manual_seed(0)
    eager = DropoutNet()
    lazy = lazygrad.lazy(copy.deepcopy(eager), policy=policy)
    x = torch.randn(16, 8)
    for step in range(3):
        results = []
        for model in (lazy, eager):
            torch.manual_seed(100 + step)
            model.zero_grad(set_to_none=True)
            out, side, dropped, _ = model(x)
            (out.sum() + side.pow(2).sum()).backward()
            results.append((out, dropped))
        (out, dropped), (out_eager, dropped_eager) = results
        assert torch.equal(dropped, dropped_eager), f"step {step}: another Dropout mask"
        assert_close(out.detach(), out_eager.detach(), f"step {step} output")
        for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"step {step} grad of {name}")
    assert type(out.grad_fn).__name__ == "LazyFunctionBackward"
    assert lazygrad.stats(lazy).fallbacks == 0


class Scaled(torch.nn.Module):
    """A tensor made in the forward (`torch.tensor(...)`) is a constant of the traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.linear(x)
        return y * torch.tensor([1.0, 2.0, 3.0]), y.sum()


@pytest.mark.parametrize("policy", ["predict", "all", "recompute"])
def test_tensor_constants_of_the_forward_reach_every_policy_backward(policy):
    torch.manual_seed(0)
    eager = Scaled()
    model = lazygrad.lazy(copy.deepcopy(eager), policy=policy, strict=True)
    x = torch.randn(2, 4)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        scaled, total = model(x)
        expected_scaled, expected_total = eager(x)
        assert_close(scaled, expected_scaled, "scaled")
        assert_close(total, expected_total, "total")
        (scaled.square().sum() + total).backward()
        (expected_scaled.square().sum() + expected_total).backward()
        for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
            assert_close(param.grad, expected.grad, name)
    stats = lazygrad.stats(model)
    assert stats.fallbacks == 0 and stats.hits == 1
