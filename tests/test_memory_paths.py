"""The memory-saving paths: the vocabulary-head rewrite, the check's blockwise comparison, the
check's turn between steps, and the import of `lazygrad` without the exporter."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import threading
import time

import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CheckpointedNet,
    assert_close,
    assert_grads_equal,
    assert_loss_step_like_eager,
    stash_steps_like_eager,
)
from torch.utils._python_dispatch import TorchDispatchMode

import lazygrad
from lazygrad import attach, graph_pair, turns
from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch
from lazygrad.verify import VerificationError, _compare, _Float64, _ForwardCheck, _Suspects


class Head(torch.nn.Module):
    """A language-model head: matmul with a tied weight, a bias, a cross-entropy with ignored
    labels; returns (loss, logits, a side output)."""

    def __init__(self, vocab: int = 50, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.bias = torch.nn.Parameter(torch.randn(vocab))
        self.side = torch.nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        hidden = torch.tanh(self.embed(ids))
        logits = hidden @ self.embed.weight.t() + self.bias
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss, logits, self.side(hidden[:, 0])


@pytest.mark.parametrize("trained", ["side", "loss", "logits"])
def test_head_rewrite_keeps_outputs_and_gradients_equal_to_eager(trained):
    torch.manual_seed(0)
    eager = Head()
    lazy = lazygrad.lazy(Head())
    lazy.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 50, (4, 6))
    labels = torch.where(torch.rand(4, 6) < 0.5, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]
    pick = {"side": lambda o: o[2].square().mean(), "loss": lambda o: o[0],
            "logits": lambda o: o[1].square().mean() + o[0]}[trained]
    for step in range(3):
        for m in (lazy, eager):
            m.zero_grad(set_to_none=True)
        got, want = lazy(ids, labels), eager(ids, labels)
        for index, (a, b) in enumerate(zip(got, want)):
            assert_close(a.detach(), b.detach(), f"step {step}: output {index}")
        pick(got).backward()
        pick(want).backward()
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2


def test_nsp_only_head_exports_one_gemm_and_no_log_softmax_over_the_vocabulary():
    config = BertConfig(vocab=300, hidden=16, layers=1, heads=2)
    model = lazygrad.lazy(BertPretraining(config))
    ids, mlm, nsp = bert_batch(config, batch=2, seq=8)
    for _ in range(2):
        F.cross_entropy(model(ids, mlm, nsp)[2], nsp).backward()
    assert lazygrad.stats(model).fallbacks == 0
    runtime = attach.installed(model)
    (entry,) = runtime._pairs.values()
    nodes = entry.pair.graphs.forward.graph.node
    softmaxes = [n for n in nodes if n.op_type == "LogSoftmax"]
    vocab_sized = [n for n in softmaxes if _vocab_input(entry.pair.graphs.forward, n, 300)]
    assert not vocab_sized, "the MLM loss still materialises a log-softmax over the vocabulary"
    assert any(n.op_type == "ReduceLogSumExp" for n in nodes)


def test_a_loss_over_the_vocabulary_stashes_no_log_softmax():
    """`loss.backward()` through the MLM head: the backward needs the log-softmax (its exponent,
    the probabilities), and the logits are an output anyway, so the backward computes them
    again from the logits (its graph has a vocabulary-sized Softmax, `peephole.softmax_for_exp`)
    and the forward returns one vocabulary-sized tensor, the logits (its own log-softmax is a
    transient); outputs and gradients stay eager's."""
    config = BertConfig(vocab=300, hidden=16, layers=1, heads=2)
    torch.manual_seed(0)
    eager = BertPretraining(config)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    ids, mlm, nsp = bert_batch(config, batch=2, seq=8)
    run_lazy, recorded = _recording_forward_shapes(lazy)
    for step in range(3):
        assert_loss_step_like_eager(lazy, eager, (ids, mlm, nsp), f"step {step}", run_lazy)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2
    sizes = [[shape[-1] for shape in shapes if shape and shape[-1] == 300] for shapes in recorded]
    assert sizes and all(found == [300] for found in sizes), sizes
    (entry,) = attach.installed(lazy)._pairs.values()
    backward_graph = entry.pair.graphs.backward
    assert [n for n in backward_graph.graph.node
            if n.op_type == "Softmax" and _vocab_input(backward_graph, n, 300)]


def test_attention_probabilities_are_stashed_once_under_dropout_p0():
    """`dropout(p=0)` in training traces as a copy of the softmax, which eager never makes; the
    softmax's derivative reads the softmax and the matmul's reads the copy, so both used to be
    stashed. The copy is dropped before partitioning: one (batch, heads, seq, seq) tensor per
    layer leaves the forward, and outputs and gradients stay eager's."""
    config = BertConfig(vocab=50, hidden=16, layers=2, heads=2)
    torch.manual_seed(0)
    eager = BertPretraining(config)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    ids, mlm, nsp = bert_batch(config, batch=3, seq=7)
    run_lazy, recorded = _recording_forward_shapes(lazy)
    for step in range(3):
        assert_loss_step_like_eager(lazy, eager, (ids, mlm, nsp), f"step {step}", run_lazy)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2
    counts = [shapes.count((3, 2, 7, 7)) for shapes in recorded]  # (batch, heads, seq, seq)
    assert counts and all(count == config.layers for count in counts), counts


class CopiesAnInputItMutates(torch.nn.Module):
    """A copy of a buffer taken before the buffer is updated in place: the copy holds the old
    value, so it is not its source."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old = self.scale.clone()
        self.scale.mul_(1.5)
        y = self.linear(x) * old * self.scale
        return y.sum(), y


def test_a_copy_of_an_input_mutated_later_keeps_the_old_value():
    torch.manual_seed(0)
    eager = CopiesAnInputItMutates()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    for step in range(3):
        assert_loss_step_like_eager(lazy, eager, (x,), f"step {step}")
        torch.testing.assert_close(lazy.scale, eager.scale)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2


class SquaresACopiedSlice(torch.nn.Module):
    """The backward reads a copy of the first rows of a larger tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return ((self.linear(x)[:2].clone() ** 2).sum(),)


def test_a_copy_of_a_view_is_stashed_as_the_copy_not_as_the_views_base():
    """A copy with its source's layout is dropped, but not a copy of a view: the stash would hold
    the view's base (all 8 rows) instead of the 2 rows copied."""
    torch.manual_seed(0)
    eager = SquaresACopiedSlice()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(8, 4)
    run_lazy, recorded = _recording_forward_shapes(lazy)
    for step in range(3):
        assert_loss_step_like_eager(lazy, eager, (x,), f"step {step}", run_lazy)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits >= 2
    assert recorded and all((2, 16) in found and (8, 16) not in found for found in recorded), \
        recorded


def _recording_forward_shapes(lazy: torch.nn.Module):
    """(a call of `lazy` that records the shapes of its ORT forward's results, the list of those
    records, one per forward run)."""
    recorded: list[list[tuple[int, ...]]] = []
    real = graph_pair.GraphPair.forward

    def forward(self, *args, **kwargs):
        results = real(self, *args, **kwargs)
        recorded.append([tuple(r.shape) for r in results])
        return results

    def run_lazy(*inputs):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(graph_pair.GraphPair, "forward", forward)
            return lazy(*inputs)

    return run_lazy, recorded


def _vocab_input(model: onnx.ModelProto, node: onnx.NodeProto, vocab: int) -> bool:
    inferred = onnx.shape_inference.infer_shapes(model)
    for value in inferred.graph.value_info:
        if value.name == node.input[0]:
            return value.type.tensor_type.shape.dim[-1].dim_value == vocab
    return True  # unknown: assume the worst


def test_check_compares_blockwise_and_catches_a_difference_or_nans_in_other_places():
    wanted = torch.randn(3_000_000)
    _compare(wanted.clone(), wanted, "result")
    off = wanted.clone()
    off[2_500_000] += 1.0
    with pytest.raises(VerificationError, match="differs"):
        _compare(off, wanted, "result")
    nan = wanted.clone()
    nan[5] = float("nan")
    with pytest.raises(VerificationError):
        _compare(nan, wanted, "result")
    _compare(nan.clone(), nan, "result")


def _three_results(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    doubled = x * 2
    return doubled, doubled + 1, x.sin()


def test_forward_check_compares_each_result_as_torch_makes_it_and_keeps_only_what_is_asked():
    forward = torch.fx.symbolic_trace(_three_results)
    x = torch.randn(1000)
    doubled, plus_one, sine = _three_results(x)
    compared = []

    class Recording(_ForwardCheck):
        def run_node(self, node):
            value = super().run_node(node)
            compared.append((node.name, [g is None for g in self._got]))
            return value

    got = [doubled.clone(), plus_one.clone(), sine.clone()]
    Recording(forward, got, kept={1}, suspects=_Suspects()).run(x)
    # ORT's first result is dropped when torch made it, before torch made the next ones.
    assert ("mul", [True, False, False]) in compared
    assert got[0] is None and got[2] is None and torch.equal(got[1], plus_one)

    wrong = [doubled.clone(), plus_one.clone(), sine + 1]
    suspects = _Suspects()
    _ForwardCheck(forward, wrong, kept=set(), suspects=suspects).run(x)
    with pytest.raises(VerificationError, match="forward result 2: ORT differs.*against float64"):
        suspects.judge(lambda: _Float64(forward).run(x))
    with pytest.raises(VerificationError, match="2 forward results from ORT, 3 from torch"):
        _ForwardCheck(forward, [doubled, plus_one], kept=set(), suspects=suspects)


def _cancelling(x: torch.Tensor) -> torch.Tensor:
    """Zero in exact arithmetic; float32 leaves rounding noise, which depends on the order."""
    return (x - x.mean(-1, keepdim=True)).sum(-1)


def test_a_difference_beyond_the_tolerance_is_judged_against_float64():
    """Rounding noise (a gradient that is zero in exact arithmetic, of magnitude 1e-5 where
    others reach 1) differs between ORT and torch beyond any tolerance fit for real values: the
    graphs ran in parts, or eagerly, for nothing. Such a difference is judged against the graph
    run in float64: ORT's result passes if it is within a few times torch's own float32 error
    of it, and a wrong one is still caught."""
    graph = torch.fx.symbolic_trace(_cancelling)
    torch.manual_seed(0)
    x = torch.randn(64, 4096) * 100
    wanted = _cancelling(x)
    reordered = _cancelling(x.flip(-1))  # what another kernel's order of summation gives
    assert (reordered - wanted).abs().max() > 1e-3 * wanted.abs().max() + 1e-5
    suspects = _Suspects()
    suspects.compare(0, reordered, wanted, "result")
    suspects.judge(lambda: (_Float64(graph).run(x),))
    suspects.compare(0, reordered + 0.05, wanted, "result")  # a real error of that size
    with pytest.raises(VerificationError, match="result: ORT differs.*against float64"):
        suspects.judge(lambda: (_Float64(graph).run(x),))


def test_check_waits_for_the_start_of_a_call_and_that_call_waits_for_the_check():
    order = []

    def check():
        with turns.check_turn(patience=30):
            order.append("check starts")
            time.sleep(0.2)
            order.append("check ends")

    builder = threading.Thread(target=check)
    builder.start()
    time.sleep(0.2)
    order.append("call starts")
    turns.call_starting()
    order.append("training goes on")
    builder.join()
    assert order == ["call starts", "check starts", "check ends", "training goes on"]


def test_check_without_a_call_runs_after_its_patience():
    started = time.perf_counter()
    with turns.check_turn(patience=0.1):
        pass
    assert time.perf_counter() - started < 5
    turns.call_starting()  # no check waits: returns at once


def test_import_lazygrad_imports_nothing_only_a_build_needs():
    code = ("import sys, lazygrad; print(sorted(m for m in ('onnxscript', 'torch.onnx', "
            "'torch._dynamo', 'sympy') if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert found == "[]"


def test_a_check_waiting_for_its_turn_runs_while_a_thread_waits_for_builds():
    """`lazygrad.wait_for_builds` is between steps: a check runs then, not after its patience."""
    ran = threading.Event()

    def check():
        with turns.check_turn(patience=30.0):
            ran.set()

    worker = threading.Thread(target=check)
    started = time.perf_counter()
    worker.start()
    time.sleep(0.2)  # the check is waiting for its turn
    with turns.between_steps():
        assert ran.wait(5.0)
    worker.join()
    assert time.perf_counter() - started < 10.0


@pytest.mark.parametrize("arena", [False, True])
def test_with_or_without_ort_memory_arena_the_steps_are_eagers(arena, monkeypatch):
    """ORT allocates as torch does by default; `arena=True` gives it its own arena, for speed.
    Either way: eager's outputs and gradients, step after step, and every step through ORT."""
    made = []

    class Recorded(graph_pair.GraphSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.arena)

    monkeypatch.setattr(graph_pair, "GraphSession", Recorded)
    torch.manual_seed(0)
    config = BertConfig(vocab=200, hidden=32, layers=2, heads=4)
    model = BertPretraining(config)
    lazy = lazygrad.lazy(copy.deepcopy(model), arena=arena)
    batch = bert_batch(config, batch=2, seq=8)
    for step in range(3):
        for m in (lazy, model):
            m.zero_grad(set_to_none=True)
        out, expected = lazy(*batch), model(*batch)
        for got, wanted in zip(out, expected):
            assert_close(got.detach(), wanted.detach(), f"step {step} output")
        (out[0] + out[2].sum()).backward()
        (expected[0] + expected[2].sum()).backward()
        assert_grads_equal(lazy, model, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits == 2
    assert made and set(made) == {arena}


def test_arena_must_be_a_bool():
    with pytest.raises(ValueError, match="arena must be True or False, got 'yes'"):
        lazygrad.lazy(torch.nn.Linear(2, 2), arena="yes")


def test_activation_checkpointing_keeps_its_memory_saving_through_ort():
    """Traced by AOTAutograd as plain code, a checkpointed region's activations were all saved:
    a model trained with activation checkpointing to fit its batch saved as much as without it
    (a 4-layer BERT: 44.4 MiB where eager saves 2.6). The region's ops are now tagged for
    recomputation, as torch.compile tags them: the forward saves what enters each region (and
    the dropout masks), the backward recomputes the rest. Outputs and gradients are eager's,
    every step through ORT (dropout replayed in the recomputation)."""
    x = torch.randn(16, 64, 32)
    saved = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        eager = CheckpointedNet(checkpointed)
        lazy = lazygrad.lazy(copy.deepcopy(eager))
        steps = stash_steps_like_eager(lazy, eager, x, f"checkpointed={checkpointed}, ")
        saved[checkpointed, "lazy"], saved[checkpointed, "eager"] = steps[-1]
        stats = lazygrad.stats(lazy)
        assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0
    activation = x.numel() * 4
    assert saved[True, "eager"] == 4 * activation  # each region's input, the head's
    assert saved[False, "lazy"] > 20 * activation  # each block's: several times x
    # eager's, and each region's dropout draw and mask (eager's recomputation draws them anew)
    assert saved[True, "lazy"] <= saved[True, "eager"] + 3 * 1.25 * activation


def test_a_reentrant_checkpoint_is_captured_with_eagers_semantics():
    """A reentrant checkpoint's backward calls `torch.autograd.backward`, which AOTAutograd's
    trace refuses: the model ran in parts. It is now traced as a region to recompute. As in
    eager, a region none of whose inputs requires grad passes no gradient (the first block's
    parameters keep `.grad is None`); given an input that requires grad, every block trains."""
    for requires_grad in (False, True):
        torch.manual_seed(0)
        eager = CheckpointedNet(True, reentrant=True)
        lazy = lazygrad.lazy(copy.deepcopy(eager))
        for step in range(3):
            x = torch.randn(4, 8, 32, requires_grad=requires_grad)
            outputs = []
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                out = model(x)
                out.square().sum().backward()
                outputs.append(out.detach())
            assert_close(*outputs, f"output, step {step}")
            assert_grads_equal(lazy, eager, f"step {step}")
        assert (eager.blocks[0][1].weight.grad is None) == (not requires_grad)
        stats = lazygrad.stats(lazy)
        assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0


class CheckpointedNorm(torch.nn.Module):
    """A convolution and a BatchNorm checkpointed (DenseNet's memory-efficient layers)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        # No bias before the norm: its gradient is zero but for rounding, in eager too.
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.norm(self.conv(t))), x,
                                              use_reentrant=self.reentrant)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_buffer_a_checkpointed_region_updates_is_updated_as_often_as_eager_does(reentrant):
    """Eager runs a checkpointed BatchNorm again in the backward, which updates its running
    statistics a second time; a graph updated them once (running means up to 28% off eager's,
    silently). Refused, with the reason: the model runs in parts, which eager's checkpoint
    runs twice, so every buffer is eager's."""
    torch.manual_seed(0)
    eager = CheckpointedNorm(reentrant)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    with pytest.warns(lazygrad.GraphBreakWarning, match="inside a torch.utils.checkpoint"):
        for step in range(4):
            x = torch.randn(4, 3, 8, 8, requires_grad=True)
            outputs = []
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                out = model(x)
                out.square().sum().backward()
                outputs.append(out.detach())
            assert_close(*outputs, f"output, step {step}")
            assert_grads_equal(lazy, eager, f"step {step}")
            for (name, mine), theirs in zip(lazy.named_buffers(), eager.buffers(), strict=True):
                assert_close(mine.float(), theirs.float(), f"step {step}: {name}")
    assert int(eager.norm.num_batches_tracked) == 8  # twice a step, in eager
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert stats.parts["norm"].hits > 0 and stats.parts["conv"].hits > 0


@lazygrad.lazy(wait_for_builds=True)
class LazyBlock(torch.nn.Sequential):
    """A lazy class of layers, as a user makes the layers of a model lazy."""

    def forward(self, x):
        return super().forward(x)


@pytest.mark.parametrize("made_lazy", ["instances", "class"])
def test_lazy_layers_inside_checkpointed_regions_run_through_ort_recomputed_alike(made_lazy):
    """Layers made lazy, which the model checkpoints (`use_reentrant=False`, as transformers
    4's `gradient_checkpointing_enable()` called its layers): torch requires a region's
    recomputation to save what its forward saved. A lazy instance there ran as its plain self,
    silently, nothing through ORT; a lazy class crashed the first backward (`CheckpointError`:
    its first call ran eagerly behind a probe whose backward built its graphs, and the
    recomputation, later in that backward, ran through ORT). The recomputation now runs each
    call the way its forward did (`regions.py`): outputs and gradients eager's (dropout's draws
    the same), the layers through ORT from the second step, and no more saved outside the
    regions than eager."""
    x = torch.randn(4, 16, 32)
    torch.manual_seed(0)
    eager = CheckpointedNet(True)
    lazy = copy.deepcopy(eager)
    for index, block in enumerate(lazy.blocks):
        lazy.blocks[index] = lazygrad.lazy(block, wait_for_builds=True) \
            if made_lazy == "instances" else LazyBlock(*block)
    for step, (saved, eager_saved) in enumerate(stash_steps_like_eager(lazy, eager, x)):
        assert saved == eager_saved, step
    for block in lazy.blocks:
        stats = lazygrad.stats(block)
        assert stats.hits == 2 and stats.fallbacks == 0, stats
        assert stats.builds + stats.disk_hits == 1, stats  # (the blocks' graphs are alike)


def test_the_users_saved_tensor_hooks_keep_what_they_packed():
    """`torch.autograd.graph.save_on_cpu` (and any saved-tensor hooks, as activation
    compression): lazygrad's backward dropped its stash's references by hooking each saved
    tensor, which torch allows once, and the backward crashed on tensors the user's hooks had
    packed. It now leaves those to the user's hooks."""
    torch.manual_seed(0)
    eager = CheckpointedNet(False)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        x = torch.randn(4, 8, 32)
        outputs = []
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            with torch.autograd.graph.save_on_cpu():
                out = model(x)
            out.square().sum().backward()
            outputs.append(out.detach())
        assert_close(*outputs, f"output, step {step}")
        assert_grads_equal(lazy, eager, f"step {step}")
    assert lazygrad.stats(lazy).hits == 2 and lazygrad.stats(lazy).fallbacks == 0


def _save_matmuls(ctx, op, *args, **kwargs):
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in matmuls else policy.PREFER_RECOMPUTE


class SelectivelyCheckpointed(CheckpointedNet):
    """Selective activation checkpointing: a policy saves the matmuls' results and recomputes
    the rest (torch's `create_selective_checkpoint_contexts`)."""

    def forward(self, x):
        contexts = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                                     _save_matmuls)
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                                      context_fn=contexts)
        return self.head(x)


def test_selective_checkpointing_runs_whole_and_a_lazy_part_inside_it_runs_eagerly():
    """A selective checkpoint's modes tag each op with its policy and their own region number,
    None outside torch.compile, which the partitioner compares: the trace failed and the model
    ran in parts, and a part inside the region crashed the recomputation (ORT's ops were not the
    ones the forward's mode recorded). Regions are now numbered, and a lazy module called under
    a dispatch mode runs as its plain self."""
    torch.manual_seed(0)
    eager = SelectivelyCheckpointed(True)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    parted = copy.deepcopy(eager)
    parted.blocks[1] = lazygrad.lazy(parted.blocks[1])  # a lazy module inside a region
    for step in range(3):
        x = torch.randn(4, 8, 32)
        outputs = []
        for model in (lazy, parted, eager):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = model(x)
            out.square().sum().backward()
            outputs.append(out.detach())
        assert_close(outputs[0], outputs[2], f"output, step {step}")
        assert_close(outputs[1], outputs[2], f"output with a lazy part, step {step}")
        assert_grads_equal(lazy, eager, f"step {step}")
        assert_grads_equal(parted, eager, f"with a lazy part, step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0


class OpCounting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_lazy_module_under_a_dispatch_mode_runs_the_ops_eager_runs():
    """A dispatch mode of the user's (an op logger, a FLOP counter, fake tensors for a memory
    estimate) sees the module's ops: ORT's run showed it none of them."""
    torch.manual_seed(0)
    eager = CheckpointedNet(False)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(4, 8, 32)
    for _ in range(3):
        lazy(x).sum().backward()
    stats = lazygrad.stats(lazy)
    assert stats.hits == 2 and stats.fallbacks == 0  # graphs serve this call
    seen = []
    for model in (lazy, eager):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with OpCounting() as counting:
            model(x).sum().backward()
        seen.append(counting.ops)
    assert seen[0] == seen[1] and "aten.addmm.default" in seen[1]
    assert lazygrad.stats(lazy).hits == 2
