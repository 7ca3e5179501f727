"""Nested inputs and outputs (tuples, lists, dicts, dataclasses, kwargs, None, Python scalars)
come back in the same structure; grad masks are over the flattened tensor outputs."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from conftest import all_masks, assert_close, sum_step_like_eager

import lazygrad


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    scale: float
    tag: str | None = None


@dataclasses.dataclass(frozen=True)
class Prediction:
    value: torch.Tensor
    extras: dict
    label: str = "prediction"


class NestedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, batch: Batch, pair: tuple, *, offset: float = 0.0, unused=None) -> dict:
        hidden = torch.tanh(self.encode(batch.features) * batch.scale + offset)
        context = pair[0] @ pair[1]["weight"]
        return {
            "logits": self.head(hidden),
            "list": [hidden.sum(-1), None, 3, (context,)],
            "prediction": Prediction(hidden.mean(), extras={"steps": 2, "ctx": context.exp()}),
        }


def _inputs(seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    batch = Batch(torch.randn(5, 4, generator=generator), scale=2.0)
    left = torch.randn(3, 6, generator=generator, requires_grad=True)
    pair = (left, {"weight": torch.randn(6, 2, generator=generator)})
    return batch, pair


def _tensor_leaves(tree) -> list[torch.Tensor]:
    leaves, _ = lazygrad.signature.flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def test_nested_structure_comes_back_with_scalars_none_and_dataclasses():
    torch.manual_seed(0)
    model = NestedModel()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    batch, pair = _inputs(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        # The first step runs eagerly and builds the graphs at its backward.
        lazy(batch, pair, offset=0.5, unused=None)["logits"].sum().backward()
        out = lazy(batch, pair, offset=0.5, unused=None)
    expected = model(batch, pair, offset=0.5, unused=None)
    assert set(out) == {"logits", "list", "prediction"}
    assert out["list"][1] is None and out["list"][2] == 3
    assert isinstance(out["list"][3], tuple)
    assert isinstance(out["prediction"], Prediction)
    assert out["prediction"].label == "prediction" and out["prediction"].extras["steps"] == 2
    got, want = _tensor_leaves(out), _tensor_leaves(expected)
    assert len(got) == len(want) == 5
    for index, (g, w) in enumerate(zip(got, want)):
        assert g.grad_fn is not None, f"output {index} is not connected to autograd"
        assert_close(g.detach(), w.detach(), f"output {index}")
    assert type(got[0].grad_fn).__name__ == "LazyFunctionBackward"
    assert (lazygrad.stats(lazy).exports, lazygrad.stats(lazy).fallbacks) == (1, 0)


@pytest.mark.parametrize("mask", [m for m in all_masks(5) if sum(m) in (1, 2, 5)])
def test_every_mask_over_flattened_outputs_matches_eager(mask):
    torch.manual_seed(0)
    model = NestedModel()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    batch, pair = _inputs(1)
    eager_pair = (pair[0].detach().clone().requires_grad_(), pair[1])
    _tensor_leaves(lazy(batch, pair, offset=0.5))[0].sum().backward()  # first step: eager
    pair[0].grad = None
    lazy.zero_grad(set_to_none=True)
    got = _tensor_leaves(lazy(batch, pair, offset=0.5))
    want = _tensor_leaves(model(batch, eager_pair, offset=0.5))
    cotangents = [torch.randn_like(t) for t in want]
    for outputs in (got, want):
        sum((o * c).sum() for o, c, bit in zip(outputs, cotangents, mask) if bit).backward()
    for (name, p), q in zip(lazy.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert_close(p.grad, q.grad, name)
    assert (pair[0].grad is None) == (eager_pair[0].grad is None)
    if eager_pair[0].grad is not None:
        assert_close(pair[0].grad, eager_pair[0].grad, "grad of pair[0]")


def test_keyword_order_does_not_change_the_signature_but_a_scalar_value_does():
    torch.manual_seed(0)
    model = NestedModel()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    batch, pair = _inputs(2)
    first = lazy(batch, pair, offset=0.5, unused=None)
    first["logits"].sum().backward()
    second = lazy(batch, pair, unused=None, offset=0.5)
    assert lazygrad.stats(lazy).exports == 1
    assert type(second["logits"].grad_fn).__name__ == "LazyFunctionBackward"
    assert_close(second["logits"].detach(), first["logits"].detach(), "same call")
    third = lazy(batch, pair, unused=None, offset=1.5)  # scalars are baked in: a new graph
    third["logits"].sum().backward()
    assert lazygrad.stats(lazy).exports == 2
    assert_close(third["logits"].detach(), model(batch, pair, offset=1.5)["logits"], "offset 1.5")


class Opaque:
    """A plain object (not a pytree node) holding a tensor, as a Hugging Face cache does."""

    def __init__(self, tensor: torch.Tensor, note: str) -> None:
        self.tensor = tensor
        self.parts = [tensor * 2, {"scale": 0.5}]
        self.note = note


class ReturnsOpaque(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.linear(x), Opaque(self.linear(x).sum(), "kept")


def test_a_plain_object_among_the_outputs_comes_back_holding_this_calls_tensors():
    torch.manual_seed(0)
    model = ReturnsOpaque()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    seen = []
    for step in range(3):
        x = torch.randn(2, 3) + step
        for m in (lazy, model):
            m.zero_grad(set_to_none=True)
        (_, opaque), (_, expected) = lazy(x), model(x)
        seen.append(opaque)
        assert isinstance(opaque, Opaque) and opaque.note == "kept"
        assert opaque.parts[1] == {"scale": 0.5}
        assert_close(opaque.tensor.detach(), expected.tensor.detach(), f"step {step} tensor")
        assert_close(opaque.parts[0].detach(), expected.parts[0].detach(), f"step {step} part")
        (opaque.tensor + opaque.parts[0]).backward()  # connected to the parameters
        (expected.tensor + expected.parts[0]).backward()
        for (name, p), q in zip(lazy.named_parameters(), model.parameters()):
            assert_close(p.grad, q.grad, f"step {step} {name}")
    assert seen[1] is not seen[2]  # a fresh object per call
    assert type(opaque.tensor.grad_fn).__name__ == "LazyFunctionBackward"
    assert lazygrad.stats(lazy).fallbacks == 0


@pytest.mark.falls_back
def test_an_output_that_holds_a_module_falls_back_to_eager_with_one_warning():
    class ReturnsModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.linear(x), self.linear

    torch.manual_seed(0)
    model = ReturnsModule()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    x = torch.randn(2, 3)
    with pytest.warns(lazygrad.FallbackWarning, match="Linear"):
        out, module = lazy(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        out, module = lazy(x)  # the fallback is remembered: no second warning
    assert module is lazy.linear
    out.sum().backward()
    model(x)[0].sum().backward()
    for (name, p), q in zip(lazy.named_parameters(), model.parameters()):
        assert_close(p.grad, q.grad, name)
    stats = lazygrad.stats(lazy)  # its own code in eager PyTorch, its Linear on its own
    assert stats.breaks == 1 and stats.fallbacks == 0 and stats.parts["linear"].exports == 1


class LengthCache:
    """A cache that counts the positions it saw, as Hugging Face's sliding-window layer does
    (`cumulative_length += key_states.shape[-2]`)."""

    def __init__(self) -> None:
        self.length = 0
        self.keys: torch.Tensor | None = None


class ReturnsSizes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        cache = LengthCache()
        cache.keys = self.linear(x)
        cache.length += x.shape[1]
        return {"out": self.linear(x).sum(-1), "batch": x.shape[0], "cache": cache,
                "half": x.shape[1] // 2, "scale": 0.5}


def test_sizes_among_the_outputs_are_this_calls_sizes():
    """A number the forward computes from sizes is a symbol in the trace: each call's result
    gets its own (`outputs.sized_numbers`), never the first call's. It ran in parts before."""
    torch.manual_seed(0)
    model = ReturnsSizes()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    for step, (batch, length) in enumerate([(2, 4), (2, 4), (3, 5), (5, 8), (2, 4)]):
        x = torch.randn(batch, length, 3)
        for m in (lazy, model):
            m.zero_grad(set_to_none=True)
        got, want = lazy(x), model(x)
        assert (got["batch"], got["half"], got["scale"]) == (batch, length // 2, 0.5), step
        assert got["cache"].length == want["cache"].length == length, step
        assert_close(got["cache"].keys.detach(), want["cache"].keys.detach(), f"step {step}")
        (got["out"].sum() + got["cache"].keys.sum()).backward()
        (want["out"].sum() + want["cache"].keys.sum()).backward()
        for (name, p), q in zip(lazy.named_parameters(), model.parameters()):
            assert_close(p.grad, q.grad, f"step {step} {name}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 0 and stats.fallbacks == 0, stats.reasons
    assert stats.hits == 3  # (2, 4) exact; at (3, 5) sizes become symbols: its graph serves
    # the last two calls


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


def _script(target):
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; code still uses it
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(target)


_scripted_gelu = _script(_gelu)


class HoldsScripted(torch.nn.Module):
    """A `torch.jit.script`-ed submodule and function, as older code scripts them for speed."""

    def __init__(self) -> None:
        super().__init__()
        self.scripted = _script(torch.nn.Linear(6, 8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(_scripted_gelu(self.scripted(x)))


def test_a_torchscript_submodule_trains_through_ort_like_eager(private_disk_cache):
    """Its parameters live in a TorchScript mapping without `dict.get`: the module state's
    read crashed at the first call, and so did the disk index's key."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(HoldsScripted())  # a deepcopy of a TorchScript module is not its twin
    eager, lazy = models[0], lazygrad.lazy(models[1], wait_for_builds=True)
    for step in range(4):
        x = torch.randn(3 + step % 2, 6)
        for m in (lazy, eager):
            m.zero_grad(set_to_none=True)
        got, want = lazy(x), eager(x)
        assert_close(got.detach(), want.detach(), f"output, step {step}")
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, f"step {step} {name}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 2


class HoldsCompiled(torch.nn.Module):
    """A `torch.compile`d submodule, as a user compiles the part they know is slow."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()),
                                  backend="eager")
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_compiled_submodule_trains_through_ort_like_eager():
    """The trace runs its code as eager does (dynamo's frame saves and restores the generators'
    state, which the trace refused as a draw: the model ran in parts with that reason)."""
    torch.manual_seed(0)
    eager = HoldsCompiled()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(4):
        sum_step_like_eager(lazy, eager, (torch.randn(5, 6),), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 3


class LazyHeads(torch.nn.Module):
    """`nn.LazyLinear` (its parameters get their shapes at the first call) and heads kept in a
    ParameterList and a ParameterDict."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.LazyLinear(8)
        self.heads = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 2))
                                             for _ in range(2)])
        self.scales = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.ones(2)),
                                              "b": torch.nn.Parameter(torch.full((2,), 2.0))})

    def forward(self, x):
        h = torch.relu(self.body(x))
        return h @ self.heads[0] * self.scales["a"], h @ self.heads[1] * self.scales["b"]


def test_a_lazy_linear_and_parameter_containers_train_like_eager():
    """The first call read the uninitialized parameters' shapes for its signature and
    crashed; now a call with an unmaterialised parameter runs eagerly, which gives it its
    shape, and the next calls run through ORT."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(LazyHeads())
    eager, lazy = models[0], lazygrad.lazy(models[1], wait_for_builds=True)
    for step in range(5):
        x = torch.randn(4, 5)
        outputs = []
        for m in (lazy, eager):
            torch.manual_seed(step)  # the lazy parameters are drawn at the first call
            m.zero_grad(set_to_none=True)
            outputs.append(m(x))
        got, want = outputs
        for index, (a, b) in enumerate(zip(got, want)):
            assert_close(a.detach(), b.detach(), f"output {index}, step {step}")
        (got[0].sum() + (got[1].square().sum() if step % 2 else 0)).backward()
        (want[0].sum() + (want[1].square().sum() if step % 2 else 0)).backward()
        for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert_close(p.grad, q.grad, f"step {step} {name}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits >= 2
