"""Shared helpers: reference gradients from PyTorch, and the models under test."""

from __future__ import annotations

import os

# Tests compare steps one by one: a step that needs new graphs waits for them (the tiering
# tests, tests/test_tiering.py, turn this off per model).
os.environ.setdefault("LAZYGRAD_WAIT_FOR_BUILDS", "1")

import copy
import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

import lazygrad
from lazygrad.examples.models import BertConfig, BertPretraining, MoELayer, ThreeHeadMLP, bert_batch

RTOL = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: one number per tensor, robust to tiny entries
    (0 for tensors of no elements)."""
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-12)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    error = relative_error(actual, expected)
    assert error <= RTOL, f"{what}: relative error {error:.2e} > {RTOL:.0e}"


def assert_grads_equal(lazy: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    """Every parameter gradient is eager's, and `.grad is None` exactly where eager's is."""
    lazy_params, eager_params = dict(lazy.named_parameters()), dict(eager.named_parameters())
    assert list(lazy_params) == list(eager_params), what
    for name, q in eager_params.items():
        p = lazy_params[name]
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}.grad is None differs"
        if q.grad is not None:
            assert_close(p.grad, q.grad, f"{what}: {name}.grad")


def assert_loss_step_like_eager(
    lazy: torch.nn.Module, eager: torch.nn.Module, inputs: Sequence, what: str,
    run_lazy: Callable[..., Sequence[torch.Tensor]] | None = None,
    loss: Callable[[Sequence[torch.Tensor]], torch.Tensor] = lambda outputs: outputs[0],
) -> None:
    """One step of both models (grads zeroed, forward, backward of `loss` of the outputs:
    output 0, the model's loss): the outputs and the gradients are eager's. `run_lazy`: how to
    call the lazy model (default: `lazy` itself)."""
    for module in (lazy, eager):
        module.zero_grad(set_to_none=True)
    got = (run_lazy or lazy)(*inputs)
    want = eager(*inputs)
    for index, (a, b) in enumerate(zip(got, want)):
        assert_close(a.detach(), b.detach(), f"{what}: output {index}")
    loss(got).backward()
    loss(want).backward()
    assert_grads_equal(lazy, eager, what)


def sum_step_like_eager(
    lazy: torch.nn.Module, eager: torch.nn.Module, inputs: Sequence, what: str,
    loss: Callable[[torch.Tensor], torch.Tensor] = torch.sum,
) -> torch.Tensor:
    """One step of two single-output models (grads zeroed, forward, backward of `loss` of the
    output: its sum): the output and the gradients are eager's. Returns the lazy model's
    output."""
    for module in (lazy, eager):
        module.zero_grad(set_to_none=True)
    got, want = lazy(*inputs), eager(*inputs)
    assert_close(got.detach(), want.detach(), f"{what}: output")
    loss(got).backward()
    loss(want).backward()
    assert_grads_equal(lazy, eager, what)
    return got


def squares_step_like_eager(
    lazy: torch.nn.Module, eager: torch.nn.Module, inputs: Sequence, what: str
) -> torch.Tensor:
    """`sum_step_like_eager` on the sum of the output's squares (a gradient that depends on
    the output, where the sum's is constant)."""
    return sum_step_like_eager(lazy, eager, inputs, what, lambda out: out.square().sum())


def all_masks(count: int) -> list[tuple[bool, ...]]:
    """Every non-empty grad mask over `count` outputs."""
    return [m for m in itertools.product([False, True], repeat=count) if any(m)]


def counted_rewrites(monkeypatch, stage, name: str = "rewrite") -> list[int]:
    """What each call of `stage.rewrite` (or of the function `name`: a capture stage that
    rewrites a graph and says how many times) rewrote, in order, from now on in this test."""
    made: list[int] = []
    rewrite = getattr(stage, name)
    monkeypatch.setattr(stage, name, lambda *args: made.append(rewrite(*args)) or made[-1])
    return made


def lazy_copy(model: torch.nn.Module, **options) -> torch.nn.Module:
    return lazygrad.lazy(copy.deepcopy(model), **options)


def compose_loss(
    outputs: Sequence[torch.Tensor], mask: Sequence[bool], cotangents: Sequence[torch.Tensor]
) -> torch.Tensor:
    """sum_i <cotangent_i, output_i> over the masked outputs: its gradient is the VJP."""
    return sum((out * cot).sum() for out, bit, cot in zip(outputs, mask, cotangents) if bit)


def reference_vjp(
    model: torch.nn.Module,
    inputs: tuple,
    mask: Sequence[bool],
    cotangents: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], tuple]:
    """Outputs, parameter gradients and input gradients from `torch.func.vjp`."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    float_inputs = tuple(t for t in inputs if t.is_floating_point() and t.requires_grad)

    def run(params, *diff_inputs):
        it = iter(diff_inputs)
        call = tuple(next(it) if (t.is_floating_point() and t.requires_grad) else t for t in inputs)
        return torch.func.functional_call(model, params, call)

    outputs, vjp = torch.func.vjp(run, params, *[t.detach() for t in float_inputs])
    cots = tuple(
        cot if bit else torch.zeros_like(out) for out, bit, cot in zip(outputs, mask, cotangents)
    )
    param_grads, *input_grads = vjp(cots)
    return outputs, param_grads, tuple(input_grads)


def eager_none_pattern(
    model: torch.nn.Module, inputs: tuple, mask: Sequence[bool]
) -> dict[str, bool]:
    """Which parameters eager PyTorch leaves with `.grad is None` for this mask."""
    model = copy.deepcopy(model)
    outputs = model(*inputs)
    compose_loss(outputs, mask, [torch.ones_like(o) for o in outputs]).backward()
    return {name: p.grad is None for name, p in model.named_parameters()}


MODEL_CASES: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {}


def model_case(name: str):
    def register(factory):
        MODEL_CASES[name] = factory
        return factory

    return register


@model_case("three_head_mlp")
def _mlp() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    return ThreeHeadMLP(), (torch.randn(6, 16),)


@model_case("bert")
def _bert() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    config = BertConfig(vocab=500, hidden=32, layers=2, heads=4)
    return BertPretraining(config), bert_batch(config, batch=3, seq=12)


@model_case("moe")
def _moe() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    return MoELayer(hidden=16, experts=4), (torch.randn(3, 5, 16),)


@pytest.fixture(autouse=True)
def private_disk_cache(tmp_path, monkeypatch) -> Path:
    """Each test gets its own on-disk graph cache, so counts of builds do not leak across tests."""
    directory = tmp_path / "graph-cache"
    monkeypatch.setenv("LAZYGRAD_CACHE_DIR", str(directory))
    return directory


@pytest.fixture(autouse=True)
def no_silent_fallback(request):
    """A fallback passes any gradient test (eager computes the gradients): every test fails on a
    FallbackWarning unless it is marked `falls_back` (it tests a fallback on purpose)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", lazygrad.FallbackWarning)
        yield
    if request.node.get_closest_marker("falls_back") is None:
        fallbacks = [str(w.message) for w in caught
                     if issubclass(w.category, lazygrad.FallbackWarning)]
        assert not fallbacks, f"unexpected fallback: {fallbacks}"


def ran_through_ort(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether these outputs came from a lazy call through ONNX Runtime (not an eager step):
    the autograd node of the call, or of the root an output is a view of (made in torch)."""
    nodes = [o.grad_fn for o in outputs]
    for _ in range(8):  # a view's chain of view ops, at most
        if any(type(n).__name__ == "LazyFunctionBackward" for n in nodes):
            return True
        nodes = [parent for n in nodes if n is not None for parent, _ in n.next_functions]
    return False


@pytest.fixture(params=sorted(MODEL_CASES))
def case(request) -> tuple[str, torch.nn.Module, tuple]:
    model, inputs = MODEL_CASES[request.param]()
    return request.param, model, inputs


class CheckpointedNet(torch.nn.Module):
    """Residual blocks, each run through `torch.utils.checkpoint` when `checkpointed`:
    non-reentrant (as transformers' `gradient_checkpointing_enable` runs its layers) or
    reentrant (torch's default where `use_reentrant` is not passed)."""

    def __init__(self, checkpointed: bool, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(32), torch.nn.Linear(32, 128), torch.nn.GELU(),
            torch.nn.Linear(128, 32), torch.nn.Dropout(0.1)) for _ in range(3))
        self.head = torch.nn.Linear(32, 5)
        self.checkpointed, self.reentrant = checkpointed, reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointed:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = x + block(x)
        return self.head(x)


def stash_step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One step (grads zeroed, forward, backward of the squares' sum): the output, and the
    bytes of the activations the forward saved for the backward (saved tensors of `x`'s size
    or more, lazygrad's stash included; not the parameters)."""
    saved = [0]

    def pack(tensor):
        if tensor.numel() >= x.numel():
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    out.square().sum().backward()
    return out.detach(), saved[0]


def stash_steps_like_eager(lazy: torch.nn.Module, eager: torch.nn.Module, x: torch.Tensor,
                           what: str = "", steps: int = 3) -> list[tuple[int, int]]:
    """`steps` steps of `lazy` and `eager` on `x` (`stash_step`, the generator seeded alike for
    both), each step's output and gradients eager's: the bytes each step saved, (lazy's,
    eager's)."""
    saved = []
    for step in range(steps):
        torch.manual_seed(step)
        got, lazy_saved = stash_step(lazy, x)
        torch.manual_seed(step)
        want, eager_saved = stash_step(eager, x)
        assert_close(got, want, f"{what}output, step {step}")
        assert_grads_equal(lazy, eager, f"{what}step {step}")
        saved.append((lazy_saved, eager_saved))
    return saved


def run_onnx_as_written(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """`model` run once by ORT's CPU provider with its graph optimisations off: the graph a
    rewrite made, not ORT's own rewrite of it."""
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@functools.cache
def cuda_usable() -> bool:
    """Whether torch has a CUDA device and ORT's CUDA provider loads (it is listed even where
    its libraries, CUDA 11.8 or cuDNN 8, fail to load)."""
    from lazygrad.session import cuda_provider_available

    if not (torch.cuda.is_available() and cuda_provider_available()):
        return False
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    try:
        onnxruntime.InferenceSession(model.SerializeToString(),
                                     providers=["CUDAExecutionProvider"])
    except Exception:
        return False
    return True


def trained_small_bert(steps: int):
    """A 2-layer BERT-shaped model trained `steps` steps, each step's outputs and gradients
    eager's (`assert_loss_step_like_eager`): the lazy model, and the cache entry of its pair
    with a backward (to read the graphs it runs)."""
    from lazygrad import attach

    torch.manual_seed(0)
    config = BertConfig(vocab=300, hidden=32, layers=2, heads=2)
    eager = BertPretraining(config)
    lazy = lazy_copy(eager)
    inputs = bert_batch(config, batch=2, seq=8)
    for step in range(steps):
        assert_loss_step_like_eager(lazy, eager, inputs, f"step {step}")
    (entry,) = [e for e in attach.installed(lazy)._pairs.values() if e.pair.graphs.backward]
    return lazy, entry
