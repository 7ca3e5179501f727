"""Bad input gives a clear error naming the input (expected vs actual), and the model still works.

Errors are raised only where eager PyTorch fails too: a new dtype, device or rank that eager
accepts is a new signature (a new export), not an error.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from conftest import assert_close, assert_grads_equal, ran_through_ort

import lazygrad
import lazygrad.runtime as runtime


class Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = x.shape
        h = torch.tanh(self.proj(x)) * mask.unsqueeze(-1)
        return self.out(h).sum(1), h.mean()


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = Tagger()
    return lazygrad.lazy(copy.deepcopy(model)), model


def _inputs(batch: int = 2, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 100 + seq)
    return torch.randn(batch, seq, 8, generator=generator), torch.ones(batch, seq)


def _assert_still_trains_like_eager(lazy: torch.nn.Module, eager: torch.nn.Module) -> None:
    x, mask = _inputs(3, 4)
    for model in (lazy, eager):
        model.zero_grad(set_to_none=True)
    out, aux = lazy(x, mask)
    out_eager, aux_eager = eager(x, mask)
    assert_close(out.detach(), out_eager.detach(), "output after the error")
    (out.sum() + aux).backward()
    (out_eager.sum() + aux_eager).backward()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name} after the error")
    assert lazygrad.stats(lazy).fallbacks == 0




def test_wrong_dtype_names_the_argument_and_the_exported_dtype():
    lazy, eager = _pair()
    x, mask = _inputs()
    lazy(x, mask)
    expected = re.escape(
        "lazygrad: argument 0 ('x'): expected dtype torch.float32 (as exported), got torch.float64"
    )
    with pytest.raises(RuntimeError, match=expected) as caught:
        lazy(x.double(), mask)
    assert "Eager PyTorch fails too" in str(caught.value)
    assert caught.value.__cause__ is not None  # eager's own error is chained
    _assert_still_trains_like_eager(lazy, eager)


def test_wrong_dtype_of_a_keyword_argument_on_the_first_call():
    lazy, eager = _pair()
    x, mask = _inputs()
    expected = re.escape(
        "argument 0 ('x'): expected dtype torch.float32 (the module's parameters), "
        "got torch.float16"
    )
    with pytest.raises(RuntimeError, match=expected):
        lazy(x.half(), mask=mask)
    lazy(x, mask=mask)
    with pytest.raises(RuntimeError, match=re.escape("argument 'mask': expected dtype")):
        lazy(x, mask=mask.to(torch.complex64))
    _assert_still_trains_like_eager(lazy, eager)


def test_wrong_device_names_the_argument_and_both_devices():
    lazy, eager = _pair()
    x, mask = _inputs()
    lazy(x, mask)
    expected = re.escape("argument 1 ('mask'): expected device cpu (as exported), got meta")
    with pytest.raises(RuntimeError, match=expected):
        lazy(x, mask.to("meta"))
    _assert_still_trains_like_eager(lazy, eager)


def test_wrong_rank_keeps_eagers_exception_type_and_names_the_rank():
    lazy, eager = _pair()
    x, mask = _inputs()
    lazy(x, mask)
    expected = re.escape("argument 0 ('x'): expected rank 3 (as exported), got 2")
    with pytest.raises(ValueError, match=expected):
        lazy(x[0], mask)
    _assert_still_trains_like_eager(lazy, eager)


def test_wrong_size_of_the_same_rank_raises_eagers_error():
    lazy, eager = _pair()
    x, mask = _inputs()
    lazy(x, mask)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        lazy(torch.randn(2, 5, 7), mask)  # same signature: ORT refuses, then eager does
    _assert_still_trains_like_eager(lazy, eager)


def test_missing_and_extra_arguments_raise_pythons_type_error():
    lazy, eager = _pair()
    x, mask = _inputs()
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'mask'"):
        lazy(x)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias'"):
        lazy(x, mask, bias=x)
    _assert_still_trains_like_eager(lazy, eager)


def test_backward_twice_without_retain_graph_is_pytorchs_error():
    lazy, eager = _pair()
    x, mask = _inputs()
    out, _ = lazy(x, mask)
    loss = out.sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    _assert_still_trains_like_eager(lazy, eager)


def test_backward_twice_with_retain_graph_accumulates_like_eager():
    lazy, eager = _pair()
    x, mask = _inputs()
    for model in (lazy, eager):
        out, aux = model(x, mask)
        loss = out.sum() + aux
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, name)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_create_graph_gives_eagers_gradients_and_second_order_gradients(how):
    """A gradient penalty (WGAN-GP) or MAML differentiates the gradients: ORT's backward
    records no graph, so such a backward is eager's, from the step's own inputs (it raised
    NotImplementedError before). The forward still ran through ORT."""
    lazy, eager = _pair()
    x, mask = _inputs()
    out, aux = lazy(x.clone().requires_grad_(True), mask)
    (out.square().sum() + aux).backward()  # the first step runs eagerly and builds the graphs
    for model in (lazy, eager):
        model.zero_grad(set_to_none=True)
    results = []
    for model in (lazy, eager):
        inputs = x.clone().requires_grad_(True)
        out, aux = model(inputs, mask)
        loss = out.square().sum() + aux
        if how == "backward":
            loss.backward(create_graph=True)
            first = [model.proj.weight.grad, inputs.grad]
            # PyTorch's own cycle (a gradient whose graph saves its leaf) would keep both
            # models alive past the test: gradients that hold a graph are let go of here.
            inputs.grad = None
        else:
            first = list(torch.autograd.grad(loss, [model.proj.weight, inputs],
                                             create_graph=True))
        model.zero_grad(set_to_none=True)
        penalty = sum(g.square().sum() for g in first)
        penalty.backward()
        results.append((out, first, [p.grad for p in model.parameters()]))
    (out, first, second), (out_eager, first_eager, second_eager) = results
    assert type(out.grad_fn).__name__ == "LazyFunctionBackward"
    assert_close(out.detach(), out_eager.detach(), "output")
    for index, (got, expected) in enumerate(zip(first, first_eager)):
        assert_close(got.detach(), expected.detach(), f"gradient {index}")
    for (name, _), got, expected in zip(lazy.named_parameters(), second, second_eager):
        assert (got is None) == (expected is None), name
        if expected is not None:
            assert_close(got, expected, f"second-order gradient of {name}")
    _assert_still_trains_like_eager(lazy, eager)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_that_creates_a_graph_builds_no_pair_that_would_never_serve():
    """A gradient penalty's call (its input requires grad, its first backward creates a graph)
    built a pair for that backward's mask at it, which never served: such a backward runs in
    eager PyTorch whatever is built (a helper's WGAN-GP probe: a pair with 0 hits). Now only
    the plain backward after it (the penalty's, through the same call) builds, and serves."""
    lazy, eager = _pair()
    x, mask = _inputs()
    for step in range(3):
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        gradients = []
        for model in (lazy, eager):
            inputs = x.clone().requires_grad_(True)
            out, aux = model(inputs, mask)
            (grad,) = torch.autograd.grad(out.square().sum() + aux, inputs, create_graph=True)
            grad.square().sum().backward()
            gradients.append(grad.detach())
        assert_close(*gradients, f"step {step}: input gradient")
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.builds == 1 and stats.fallbacks == 0
    assert all(entry.hits > 0 for entry in stats.entries)


@pytest.mark.falls_back
@pytest.mark.parametrize(
    ("op", "stage"),
    [
        (lambda h: torch.cummax(h, -1)[0], "ONNX export failed"),  # no ONNX translation
        # a size read through NumPy, which no trace sees (capture/checks.py)
        (lambda h: h[:int(h.detach().numpy().argmax()) % 3 + 1], "depends on tensor values"),
    ],
    ids=["unexportable", "data-dependent"],
)
def test_unsupported_op_falls_back_with_one_warning_and_eager_gradients(op, stage):
    class Unsupported(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return op(self.linear(x)).sum(), self.linear.weight.sum()

    torch.manual_seed(0)
    model = Unsupported()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in (3, 3, 5, 5):
            x = torch.randn(seq, 4)
            lazy.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            out, _ = lazy(x)
            out_eager, _ = model(x)
            assert_close(out.detach(), out_eager.detach(), "output")
            out.backward()
            out_eager.backward()
            for (name, p), q in zip(lazy.named_parameters(), model.parameters()):
                assert_close(p.grad, q.grad, name)
    fallbacks = [w for w in caught if issubclass(w.category, lazygrad.FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    assert stage in str(fallbacks[0].message) and "Unsupported" in str(fallbacks[0].message)
    stats = lazygrad.stats(lazy)
    # Its own code runs in eager PyTorch, its Linear through ORT (a graph break).
    assert stats.breaks == 1 and stats.fallbacks == 0 and stats.parts["linear"].hits > 0


def test_nan_and_inf_in_inputs_propagate_as_in_eager():
    lazy, eager = _pair()
    x, mask = _inputs(3, 4)
    # Built and checked with finite values: NaN must not depend on what was traced.
    lazy(x, mask)[0].sum().backward()
    x = x.clone()
    x[0, 1, 2] = float("nan")
    x[1, 0, 0] = float("inf")
    x[2, 3, 5] = float("-inf")
    for model in (lazy, eager):
        model.zero_grad(set_to_none=True)
    out, aux = lazy(x, mask)
    out_eager, aux_eager = eager(x, mask)
    assert type(out.grad_fn).__name__ == "LazyFunctionBackward"
    torch.testing.assert_close(out.detach(), out_eager.detach(), equal_nan=True)
    torch.testing.assert_close(aux.detach(), aux_eager.detach(), equal_nan=True)
    assert out.isnan().any() and aux.isnan()
    (out.sum() + aux).backward()
    (out_eager.sum() + aux_eager).backward()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad.isnan(), q.grad.isnan()), name
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, rtol=1e-5, atol=1e-6)
    _assert_still_trains_like_eager(lazy, eager)


class Indexed(torch.nn.Module):
    """Token ids into an embedding, picks along a dimension, rows selected, and class labels
    into a loss: each index eager's kernels check for its range."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.head = torch.nn.Linear(6, 4)

    def forward(self, ids, picks, rows, labels):
        logits = self.head(self.embed(ids).mean(1))
        picked = logits.gather(1, picks) + logits.index_select(0, rows)[:, :1]
        return torch.nn.functional.cross_entropy(logits, labels) + picked.sum()


INDEX_INPUTS = {"ids": torch.tensor([[1, 2], [3, 9], [0, 5]]),
                "picks": torch.tensor([[0], [3], [2]]), "rows": torch.tensor([2, 0, 1]),
                "labels": torch.tensor([0, 3, -100])}


@pytest.mark.parametrize("name,bad", [("ids", -1), ("ids", 10), ("picks", -1), ("rows", -1),
                                      ("labels", -1), ("labels", 4)])
def test_an_index_out_of_its_range_raises_eagers_error_through_ort(name, bad):
    """ONNX's Gather, GatherElements and the loss's pick take -1 for the last entry, where
    eager raises: a token id or a label of -1 (a padding value taken for `ignore_index`) trained
    silently on the last row or class. The graph checks its index arguments; a call with one
    out of range runs again in eager PyTorch, which raises eager's error."""
    torch.manual_seed(0)
    eager = Indexed()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for _ in range(2):
        lazy(**INDEX_INPUTS).backward()
    inputs = {key: value.clone() for key, value in INDEX_INPUTS.items()}
    inputs[name][1].view(-1)[0] = bad
    with pytest.raises(Exception) as expected:
        eager(**inputs)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        lazy(**inputs)
    assert lazygrad.stats(lazy).hits == 1 and lazygrad.stats(lazy).fallbacks == 0
    for model in (lazy, eager):
        model.zero_grad(set_to_none=True)
    got, want = lazy(**INDEX_INPUTS), eager(**INDEX_INPUTS)
    assert_close(got.detach(), want.detach(), "the loss after the error")
    got.backward()
    want.backward()
    for (parameter, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"grad of {parameter} after the error")
    assert lazygrad.stats(lazy).hits == 2


def test_calls_that_eager_refuses_leave_the_graph_serving_the_calls_after_them():
    """A call whose graph's checks fail runs again in eager PyTorch, and where such calls are
    not rare the signature gives up its graph. A call that eager refuses too (bad data: a label
    out of range, a few corrupt batches a loop catches and skips) counted as one: the model
    ran in parts for good after four (a helper's sweep). It raises eager's error, and counts
    for nothing."""
    torch.manual_seed(0)
    eager = Indexed()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    lazy(**INDEX_INPUTS).backward()
    bad = {**INDEX_INPUTS, "labels": torch.tensor([0, 4, 1])}
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.GraphBreakWarning)
        for _ in range(2 * runtime.CHECK_MISSES):
            with pytest.raises(IndexError):
                lazy(**bad)
        lazygrad.reset_stats(lazy)
        for _ in range(2):
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
            got, want = lazy(**INDEX_INPUTS), eager(**INDEX_INPUTS)
            assert ran_through_ort((got,))
            assert_close(got.detach(), want.detach(), "the loss after the errors")
            got.backward()
            want.backward()
            assert_grads_equal(lazy, eager, "after the errors")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.eager_steps == 0 and stats.breaks == 0
    assert stats.fallbacks == 0


def test_orts_errors_name_the_node_and_its_message_without_cpp_source():
    """A reason or warning quoting ORT's error showed its C++ source line and function
    signature (a helper's sweep): the node and what it said are what a user can act on."""
    from lazygrad.session import ort_message

    raw = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running "
           "GatherElements node. Name:'node_gather' Status Message: /onnxruntime_src/"
           "onnxruntime/core/providers/cpu/tensor/gather_elements.cc:150 void "
           "onnxruntime::core_impl(const Tensor*, Tensor*, int64_t) [with Tin = long int] "
           "GatherElements op: Out of range value in index tensor\n")
    assert ort_message(RuntimeError(raw)) == (
        "ORT's GatherElements node 'node_gather' failed: GatherElements op: Out of range value "
        "in index tensor")
    plain = ("Non-zero status code returned while running Reshape node. Name:'r' Status "
             "Message: The input tensor cannot be reshaped (2, 3) to (4)")
    assert ort_message(RuntimeError(plain)) == (
        "ORT's Reshape node 'r' failed: The input tensor cannot be reshaped (2, 3) to (4)")
    other = "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x"
    assert ort_message(RuntimeError(other)) == other
