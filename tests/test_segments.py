"""A backward run in segments: eager's gradients, and the stash freed as the backward runs."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime
import pytest
import torch
from conftest import (
    MODEL_CASES,
    assert_close,
    assert_grads_equal,
    compose_loss,
    lazy_copy,
    ran_through_ort,
    reference_vjp,
)

import lazygrad
from lazygrad import attach
from lazygrad.capture import segment
from lazygrad.examples.models import BertConfig, bert_batch
from lazygrad.options import SEGMENTS as SEGMENTS_DEFAULT
from lazygrad.session import GraphSession
from lazygrad.step import Step

SEGMENTS = 3


@pytest.fixture(autouse=True)
def cut_small_graphs(monkeypatch):
    """The test models' stash is tiny: cut it anyway."""
    monkeypatch.setattr(segment, "STASH_PER_SEGMENT", 1)


class Tower(torch.nn.Module):
    """Blocks in a row, with heads at three depths (a multi-output model whose stash is spread
    over the blocks)."""

    def __init__(self, width: int = 32, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.LayerNorm(width))
            for _ in range(blocks)
        )
        self.low = torch.nn.Linear(width, 3)
        self.mid = torch.nn.Linear(width, 2)
        self.top = torch.nn.Linear(width, 4)

    def forward(self, x):
        heads = []
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index in (1, 3):
                heads.append(x)
        return self.low(heads[0]), self.mid(heads[1]), self.top(x)


def _segments(model) -> list[int]:
    """Segments per backward graph of each built pair."""
    runtime = attach.installed(model)
    return [len(entry.pair.graphs.backward_segments) for entry in runtime._pairs.values()
            if entry.pair.graphs.backward is not None]


def _step(model, lazy, inputs, mask):
    outputs = lazy(*inputs)
    cotangents = [torch.randn_like(o) for o in outputs]
    lazy.zero_grad(set_to_none=True)
    compose_loss(outputs, mask, cotangents).backward()
    expected_outputs, expected, _ = reference_vjp(model, inputs, mask, cotangents)
    for index, (got, wanted) in enumerate(zip(outputs, expected_outputs)):
        assert_close(got.detach(), wanted, f"output {index}")
    for name, p in lazy.named_parameters():
        if p.grad is not None:
            assert_close(p.grad, expected[name], f"mask {mask}: grad of {name}")
    return outputs


# Every policy on the tower; BERT (its builds take the suite's time) under the default policy.
@pytest.mark.parametrize(("policy", "name"), [
    ("predict", "tower"), ("all", "tower"), ("recompute", "tower"), ("predict", "bert"),
])
def test_segmented_backward_gives_eagers_gradients_for_every_mask(policy, name):
    if name == "tower":
        torch.manual_seed(0)
        model, inputs = Tower(), (torch.randn(64, 32),)
    else:
        model, inputs = MODEL_CASES[name]()
    lazy = lazy_copy(model, policy=policy, segments=SEGMENTS)
    # Each mask twice (a first step of a mask may be eager), then back to the first mask.
    masks = [(True, False, False), (False, True, True), (True, True, True), (True, False, False)]
    for mask in masks:
        for _ in range(2):
            outputs = _step(model, lazy, inputs, mask)
        assert ran_through_ort(outputs)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0
    if policy != "recompute":  # a recomputing backward stashes nothing to free
        assert all(count > 1 for count in _segments(lazy)), _segments(lazy)


def test_one_segment_is_the_whole_backward():
    torch.manual_seed(0)
    model, inputs = Tower(), (torch.randn(64, 32),)
    lazy = lazy_copy(model, segments=1)
    for _ in range(2):
        _step(model, lazy, inputs, (True, True, True))
    assert _segments(lazy) == [0]


def test_segments_serve_every_batch_and_width_of_a_dynamic_signature():
    model, _ = MODEL_CASES["bert"]()
    lazy = lazy_copy(model, segments=SEGMENTS)
    for batch, seq in [(3, 12), (5, 7), (2, 20), (4, 12)]:
        inputs = bert_batch(BertConfig(vocab=500), batch=batch, seq=seq, seed=batch)
        _step(model, lazy, inputs, (True, False, True))
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.fallbacks) == (2, 0)  # exact sizes, then symbols
    assert all(count > 1 for count in _segments(lazy))


def test_segments_round_trip_through_the_disk_cache(private_disk_cache):
    torch.manual_seed(0)
    model, inputs = Tower(), (torch.randn(64, 32),)
    mask = (True, False, True)
    first = lazy_copy(model, segments=SEGMENTS)
    for _ in range(2):
        _step(model, first, inputs, mask)
    second = lazy_copy(model, segments=SEGMENTS)
    for _ in range(2):
        _step(model, second, inputs, mask)
    stats = lazygrad.stats(second)
    assert (stats.builds, stats.disk_hits, stats.fallbacks) == (0, 1, 0)
    assert _segments(second) == _segments(first) and _segments(second)[0] > 1
    # Another segment count is another entry, never the stored one.
    other = lazy_copy(model, segments=1)
    _step(model, other, inputs, mask)
    assert lazygrad.stats(other).builds == 1 and _segments(other) == [0]


def test_retained_graph_backward_twice_accumulates_like_eager():
    torch.manual_seed(0)
    model, inputs = Tower(), (torch.randn(64, 32),)
    lazy = lazy_copy(model, segments=SEGMENTS)
    lazy(*inputs)[2].sum().backward()  # the first step builds
    eager = copy.deepcopy(model)
    for net in (lazy, eager):
        net.zero_grad(set_to_none=True)
        loss = sum(o.sum() for o in net(*inputs))
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads_equal(lazy, eager, "retain_graph")
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss = lazy(*inputs)[2].sum()
        loss.backward()
        loss.backward()


def test_the_stash_is_freed_segment_by_segment(monkeypatch):
    """A stashed tensor read only by the first segments is freed before the last one runs, and
    the whole stash is gone when the backward returns (nothing of lazygrad's holds it)."""
    torch.manual_seed(0)
    model, inputs = Tower(), (torch.randn(64, 32),)
    lazy = lazy_copy(model, segments=SEGMENTS)
    for _ in range(2):
        _step(model, lazy, inputs, (True, True, True))

    stash: list[weakref.ref] = []
    alive: list[int] = []  # stashed tensors alive as each backward segment starts
    forward, run = Step.forward, GraphSession.run

    def watched_forward(self, primals):
        outputs, saved = forward(self, primals)
        count, draws, _ = self._layout
        returned = {id(o) for o in outputs}
        stash[:] = [weakref.ref(t) for t in saved[count + draws:] if id(t) not in returned]
        return outputs, saved

    def watched_run(self, values):
        alive.append(sum(ref() is not None for ref in stash))
        return run(self, values)

    monkeypatch.setattr(Step, "forward", watched_forward)
    monkeypatch.setattr(GraphSession, "run", watched_run)
    outputs = lazy(*inputs)
    loss = sum(o.sum() for o in outputs)
    del outputs
    alive.clear()  # the forward's run
    loss.backward()
    (segments,) = _segments(lazy)
    assert len(alive) == segments > 1
    assert alive[0] == len(stash) > 0
    assert alive == sorted(alive, reverse=True) and alive[-1] < alive[0], alive
    assert all(ref() is None for ref in stash)


def _chain(steps: int) -> tuple[onnx.ModelProto, list[str]]:
    """A backward-like chain of `steps` steps, each reading one stashed input of `n` floats; a
    Constant node every step reads. The model and its stashed inputs."""
    stash = [f"saved{i}" for i in range(steps)]
    nodes, current = [oh.make_node("Constant", [], ["half"], value=oh.make_tensor(
        "half", onnx.TensorProto.FLOAT, [], [0.5]))], "grad"
    for i, name in enumerate(reversed(stash)):
        nodes.append(oh.make_node("Mul", [current, name], [f"m{i}"]))
        nodes.append(oh.make_node("Mul", [f"m{i}", "half"], [f"g{i}"]))
        nodes.append(oh.make_node("ReduceSum", [f"g{i}"], [f"w{i}"], keepdims=0))
        current = f"g{i}"
    vector = [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["n"])
              for n in ["grad", *stash]]
    model = oh.make_model(
        oh.make_graph(nodes, "chain", vector, [
            oh.make_tensor_value_info(current, onnx.TensorProto.FLOAT, ["n"]),
            *(oh.make_tensor_value_info(f"w{i}", onnx.TensorProto.FLOAT, [])
              for i in range(steps)),
        ]),
        opset_imports=[oh.make_opsetid("", 18)],
    )
    return model, stash


def test_split_alone_cuts_a_plain_onnx_chain_where_its_stash_is_released():
    """The stage on its own: a backward-like chain (each step reads one stashed input) cut in
    three; run in order, the segments give the whole graph's outputs, and each stashed input is
    read by one segment only. A Constant node every step reads is held by each segment, never
    passed from one to the next as an input."""
    steps = 6
    model, stash = _chain(steps)
    segments = segment.split(model, set(stash), 3, {"n": 4096})
    assert len(segments) == 3
    readers = [{value.name for value in part.graph.input} & set(stash) for part in segments]
    assert sum(map(len, readers)) == steps and set().union(*readers) == set(stash)
    assert all("half" not in {value.name for value in part.graph.input} for part in segments)
    feeds = {name: np.random.rand(8).astype(np.float32) for name in ["grad", *stash]}
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)
    values = dict(feeds)
    for part in segments:
        session = onnxruntime.InferenceSession(part.SerializeToString())
        wanted = [value.name for value in part.graph.input]
        values.update(zip([o.name for o in part.graph.output],
                          session.run(None, {name: values[name] for name in wanted})))
    for output, want in zip(model.graph.output, expected):
        np.testing.assert_allclose(values[output.name], want, rtol=1e-6)


@pytest.mark.parametrize(("per_segment", "count"), [(32, 3), (48, 2), (100, 0)])
def test_the_stash_sets_how_many_segments_the_default_cuts(monkeypatch, per_segment, count):
    """Each segment frees at least `STASH_PER_SEGMENT` of the stash: six stashed inputs of 16
    KiB (96 KiB) are cut in three where each segment must free 32 KiB, in two at 48, and not at
    all at 100, however many segments the option allows."""
    monkeypatch.setattr(segment, "STASH_PER_SEGMENT", per_segment * 1024)
    model, stash = _chain(6)
    assert len(segment.split(model, set(stash), SEGMENTS_DEFAULT, {"n": 4096})) == count
