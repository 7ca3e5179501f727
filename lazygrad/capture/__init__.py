"""Capture: (module, call, grad mask) -> a forward and a backward ONNX graph, with PyTorch's
own derivative formulas.

The stages, each callable alone: `trace` (AOTAutograd over functional_call on fake tensors),
`partition` (forward/backward split per policy, random draws lifted out), `tidy` (ONNX-friendly,
and how to feed each graph), `peephole` (the same values in fewer passes over memory),
`ignored_rows` (a loss's ignored rows left out of its backward), `broadcast_products`
(products whose operands broadcast, without the broadcast result), `few_rows` (rows summed
into a few rows, or one, as one product), `to_onnx` (direct translation), `segment` (the
backward cut into graphs run in order, to free the stash as it goes), `node_order` (the
backward as ORT is to run it, in its nodes' order), then rewrites of the ONNX graphs that
spare ORT copies (`gelu`, `stacked_products`, `reshaped_outputs`, `identity_outputs`).
`capture` runs the stages up to `few_rows`, `export` the rest; in between, `fingerprint` keys
the on-disk cache."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import onnx
import torch
import torch.fx as fx

from lazygrad.capture import (
    backward_hooks,
    broadcast_products,
    checks,
    data_lengths,
    escapes,
    few_rows,
    forward_hooks,
    gelu,
    head,
    identity_outputs,
    ignored_rows,
    layers,
    node_order,
    open_order,
    partition,
    peephole,
    python_random,
    reshaped_outputs,
    scattered_outputs,
    segment,
    stacked_products,
    symbols,
    tidy,
    to_onnx,
    trace,
)
from lazygrad.capture.aliases import Aliasing, aliasing
from lazygrad.capture.draws import Draw
from lazygrad.capture.errors import CaptureError
from lazygrad.capture.tidy import Feed, OutputSlot, OutputView, Tidy, apply_views
from lazygrad.capture.trace import Functional, refuse_reads, unchanged

__all__ = [
    "CaptureError",
    "Captured",
    "Draw",
    "Feed",
    "Graphs",
    "OutputSlot",
    "OutputView",
    "Aliasing",
    "aliasing",
    "apply_views",
    "capture",
    "export",
    "Functional",
    "refuse_reads",
    "symbols",
    "unchanged",
    "watching_first_call",
]


@dataclasses.dataclass
class Graphs:
    """A built (signature, mask): the two ONNX graphs and how to run them. Plain data: it is
    what the on-disk cache stores."""

    forward: onnx.ModelProto
    backward: onnx.ModelProto | None
    # The backward cut into graphs run in order (inputs and outputs named as in `backward`,
    # plus the values passed between them); empty: the backward runs whole.
    backward_segments: list[onnx.ModelProto]
    forward_feeds: list[Feed]  # per ONNX forward input, in input order
    backward_feeds: list[Feed]  # per ONNX backward input, in input order
    mutations: list[tuple[int, int]]  # (forward result, primal) written back after the forward
    roots: list[OutputSlot]  # what the autograd node returns (`aliases.py`)
    outputs: list[OutputView]  # per module output (flat tensor leaves), made from the roots
    grads_for: list[int]  # primal index of each backward output
    grad_reach: list[list[int]]  # per backward output: roots whose cotangents reach it
    draws: list[Draw]
    locations: dict[str, tuple[int, int]]  # size symbol -> (primal, dim)
    guards: list[str]  # size conditions (Python code) under which the graphs are valid
    differentiable: list[bool]  # per module output: requires grad in the trace
    sized: list[tuple[int, str]]  # numbers of the result that are sizes: (position, code)
    seconds: dict[str, float]
    check: int | None = None  # forward result: whether its argument checks held (`checks.py`)


@dataclasses.dataclass
class Captured:
    """The tidied FX pair before export: runnable in torch (the check runs it)."""

    tidy: Tidy
    draws: list[Draw]
    locations: dict[str, tuple[int, int]]
    guards: list[str]
    differentiable: list[bool]  # per module output: requires grad in the trace
    aliasing: Aliasing
    sized: list[tuple[int, str]]  # numbers of the result that are sizes: (position, code)
    numbers: int  # how many numbers the result holds
    seconds: dict[str, float]
    untranslatable: list[tuple[str, str]]  # (ATen op, submodule) the exporter may not translate
    # per graph (forward, backward): its top-k nodes whose order eager's kernel chooses, by
    # name, with their dimension (`open_order.py`: the check rotates their picks)
    open_order: tuple[dict[str, int], dict[str, int]]

    def fingerprint(self, *parts: object) -> str:
        """Content hash of both graphs, their input types, constants and draws, plus `parts`."""
        digest = hashlib.sha256()
        for gm in (self.tidy.forward, self.tidy.backward):
            if gm is None:
                digest.update(b"none")
                continue
            digest.update(gm.code.encode())
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    digest.update(repr(node.meta.get("val")).encode())
                elif node.op == "get_attr":
                    value = getattr(gm, node.target)
                    if isinstance(value, torch.Tensor):
                        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        digest.update(repr((self.draws, self.guards, self.tidy.roots, self.tidy.outputs,
                            self.sized, parts)).encode())
        return digest.hexdigest()


def _refuse_sizes_no_input_holds(codes: Sequence[str], locations: symbols.Locations,
                                 what: str) -> None:
    """Sizes (Python source over size symbols) that the call's inputs do not give (a length
    read from data, which only the graph computes) cannot be made outside the graph: the
    failure names the lines whose lengths to take as the first call's (`data_lengths.py`)."""
    unknown = {name for code in codes for name in compile(code, "<size>", "eval").co_names}
    unknown -= set(locations)
    if unknown:
        raise CaptureError(f"the forward {what} of sizes that no input holds",
                           lines=data_lengths.lines_named(unknown))


@contextlib.contextmanager
def watching_first_call(
    module: torch.nn.Module,
) -> Iterator[Callable[[Iterable[torch.Tensor]], None]]:
    """Around a signature's first call, which eager PyTorch runs before any trace: yields
    `refuse(own)`, to call after it, which raises CaptureError where the user's hooks on
    submodules kept a tensor or ran for side effects only, or the call put a tensor in a
    global store, as a trace would find, but before a trace hands them its tensors
    (`forward_hooks.watching_eager_call`, `escapes.GlobalStores`). `own`: the tensors the
    caller holds (the module's state, the call's inputs, what it returned)."""
    stores = escapes.GlobalStores(module)
    with forward_hooks.watching_eager_call(module) as seen:
        def refuse(own: Iterable[torch.Tensor]) -> None:
            own = list(own)
            escapes.refuse_kept_by_hooks(seen.touched, module, own)
            stores.refuse_new(own)
            forward_hooks.refuse_side_effects(seen.side_effects)

        yield refuse


def capture(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    state_names: Sequence[str],
    primals: Sequence[torch.Tensor],
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple, dict]],
    tensors_of: Callable[[Any], list[torch.Tensor]],
    mask: Sequence[bool] | None,
    recompute: bool = False,
    recompute_layers: bool = False,
    dynamic_dims: Sequence[Sequence[bool]] = (),
    sized_of: Callable[[Any], tuple[int, list[tuple[int, Any]]]] = lambda result: (0, []),
    own_roots: Sequence[bool] = (),
    reads: checks.Reads | None = None,
    fixed_lines: Collection[tuple[str, int]] = (),
) -> Captured:
    """Trace, partition and tidy one call of `forward(module, ...)` for grad `mask`.

    `primals`: the module state (named `state_names`) then the call's tensors; `rebuild` turns
    the call's tensors back into (args, kwargs), `tensors_of` lists a result's tensors. `mask`
    None: an inference graph. `recompute_layers`: the backward recomputes the activations of the
    module's repeated layers (`layers.py`). `dynamic_dims`: per call tensor, which of its sizes
    are symbols (none if empty). `reads`: what the signature's first call read from tensors'
    values (`checks.recording`; None: unknown); the lengths of ops' results it read are each
    call's, but at the lines (file, line) `fixed_lines`, where they are its own
    (`data_lengths.py`). The module is left exactly as it was, whatever happens.
    """
    started = time.perf_counter()
    backward_hooks.refuse_backward_hooks(module)
    forward_hooks.refuse_global_hooks(module)
    fn = trace.Functional(module, forward, state_names, rebuild, tensors_of, mask, sized_of,
                          own_roots, reads, fixed_lines)
    count = len(state_names)
    dynamic = [[False] * p.dim() for p in primals[:count]]
    dynamic += dynamic_dims or [[False] * p.dim() for p in primals[count:]]
    training = mask is not None and any(mask)
    with escapes.watching() as made, python_random.refusing_draws(module), \
            forward_hooks.watching(module) as side_effects, trace.unchanged(module), \
            open_order.noting() as noted:
        traced = trace.trace(fn, primals, dynamic, training, module)
    # Once the module holds its own tensors again:
    escapes.refuse_kept_tensors(made, traced.mode)
    forward_hooks.refuse_side_effects(side_effects)  # a hook that keeps a tensor is named above
    trace.refuse_state_read_around_the_swap(traced.joint, module)
    trace.refuse_updates_a_checkpoint_repeats(traced)
    outputs_share = fn.aliasing
    assert outputs_share is not None  # the trace ran it
    for _, code in fn.sized:
        _refuse_sizes_no_input_holds([code], traced.locations, f"returns a number, {code},")
    try:
        recomputed = layers.repeated_layers(module) if recompute_layers else []
        parts = partition.partition(traced, recompute, recomputed)
        head.recompute_log_softmax(parts, len(traced.mutated) + len(traced.outputs))
        for gm in (parts.forward, parts.backward):
            if gm is not None:
                head.rewrite(gm)
        masked = [i for i, bit in enumerate(outputs_share.root_mask(mask or ())) if bit]
        # Parameters changed in place (so under no_grad): the call's tensors are detached
        # copies here, whose own leaves say nothing of the caller's.
        changed = [i for i in traced.mutated if primals[i].requires_grad]
        tidied = tidy.tidy(parts, len(primals), traced.mutated, len(traced.outputs),
                           outputs_share, masked, fn.checked,
                           len(changed) if all(i < count for i in changed) else 0)
        for gm in (tidied.forward, tidied.backward):
            if gm is not None:
                peephole.rewrite(gm)
        ignored_rows.rewrite_forward(
            tidied.forward, ignored_rows.first_call_inputs(tidied, primals, "forward"))
        if tidied.backward is not None:
            ignored_rows.rewrite(tidied.backward, ignored_rows.first_call_inputs(tidied, primals))
        for gm in (tidied.forward, tidied.backward):
            if gm is not None:
                broadcast_products.rewrite(gm)
                few_rows.rewrite(gm)
    except CaptureError:
        raise
    except Exception as error:  # a graph shape this code has not met: never a wrong graph
        raise CaptureError(
            f"cannot prepare the traced graphs: {type(error).__name__}: {error}"
        ) from error
    open_picks = (open_order.found(tidied.forward, noted),
                  open_order.found(tidied.backward, noted))
    if noted and not any(open_picks):
        raise CaptureError("an unsorted top-k, whose order eager's kernel chooses, is not where "
                           "the check could prove that its order does not matter")
    for draw in parts.draws:  # made in torch, before the graph runs, from the inputs' sizes
        _refuse_sizes_no_input_holds([*draw.shape, *draw.strides], traced.locations,
                                     f"draws a random {draw.kind} tensor")
    return Captured(
        tidy=tidied,
        draws=parts.draws,
        locations=traced.locations,
        guards=traced.guards,
        differentiable=fn.differentiable,
        aliasing=outputs_share,
        sized=fn.sized,
        numbers=fn.numbers,
        seconds={"trace": time.perf_counter() - started},
        untranslatable=traced.untranslatable,
        open_order=open_picks,
    )


def export(captured: Captured, segments: int = 1) -> Graphs:
    """Translate both graphs to ONNX; map each ONNX input to where its value comes from; cut
    the backward into at most `segments` graphs (1: whole)."""
    started = time.perf_counter()
    tidied = captured.tidy
    try:
        forward = to_onnx.to_onnx(tidied.forward)
        backward = to_onnx.to_onnx(tidied.backward) if tidied.backward is not None else None
        if backward is not None:
            backward = node_order.inline_functions(backward)
            backward = scattered_outputs.added_in_torch(
                backward, reshaped_outputs.final_outputs(backward))
    except Exception as error:
        where = _submodule_translating(error, tidied)
        if where is None:  # an op with no translation that the error names
            text = _innermost(error)
            where = next((submodule for op, submodule in captured.untranslatable
                          if op.rsplit(".", 1)[0] in text), None)  # "op='aten.cummax'"
        raise CaptureError(f"ONNX export failed: {_innermost(error)}", where) from error
    backward_feeds = (
        _feeds_by_name(backward, tidied.backward, tidied.backward_feeds)
        if backward is not None and tidied.backward is not None else []
    )
    seconds = dict(captured.seconds, export=time.perf_counter() - started)
    cut = []
    if backward is not None and tidied.backward is not None and segments > 1:
        started = time.perf_counter()
        stash = {  # what the backward alone holds: forward results and random draws
            value.name for value, feed in zip(backward.graph.input, backward_feeds)
            if feed.kind in ("saved", "random")
        }
        inputs = partition.placeholders(tidied.backward)
        example = symbols.hints([p.meta.get("val") for p in inputs])
        cut = segment.split(backward, stash, segments, example)
        seconds["segment"] = time.perf_counter() - started
    # After the cut: onnx's shape inference knows no contrib op.
    forward = identity_outputs.made_by_their_source(gelu.fuse_erf_gelu(forward))
    if backward is not None:
        # Outputs whose additions torch makes (scattered_outputs) are not gradients to view.
        final = reshaped_outputs.final_outputs(backward) - scattered_outputs.outputs_involved(
            backward)
        backward, *cut = (
            identity_outputs.made_by_their_source(reshaped_outputs.unreshaped_outputs(
                gelu.fuse_erf_gelu(stacked_products.made_transposed(
                    node_order.fuse_transposed_matmuls(graph))), final))
            for graph in (backward, *cut)
        )
    return Graphs(
        forward=forward,
        backward=backward,
        backward_segments=cut,
        forward_feeds=_feeds_by_name(forward, tidied.forward, tidied.forward_feeds),
        backward_feeds=backward_feeds,
        mutations=tidied.mutations,
        roots=tidied.roots,
        outputs=tidied.outputs,
        grads_for=tidied.grads_for,
        grad_reach=tidied.grad_reach,
        draws=captured.draws,
        locations=captured.locations,
        guards=captured.guards,
        differentiable=captured.differentiable,
        sized=captured.sized,
        seconds=seconds,
        check=tidied.check,
    )


def _submodule_translating(error: BaseException, tidied: Tidy) -> str | None:
    """The submodule whose node the exporter failed to translate, where its error names one
    ("Error when translating node %sym_size_int_3"); None where it names none. (The first op
    without a translation was blamed, whatever the error: an innocent Conv1d after an FFT
    whose size the exporter could not read, whose every instance then ran eagerly.)"""
    named = re.search(r"translating node %(\w+)", str(error))
    graphs = [gm for gm in (tidied.forward, tidied.backward) if gm is not None]
    nodes = [node for gm in graphs for node in gm.graph.nodes if named and node.name == named[1]]
    return trace.submodule_of(nodes[0]) if len(nodes) == 1 else None


def _innermost(error: BaseException) -> str:
    """The exporter wraps a translation's error ("see the stack trace"): name the first cause
    too, which says what the translation could not do."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = f"{type(error).__name__}: {error}"
    if cause is not error:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


def _feeds_by_name(model: onnx.ModelProto, gm: fx.GraphModule, feeds: list[Feed]) -> list[Feed]:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = dict(zip(names, feeds))
    missing = [value.name for value in model.graph.input if value.name not in by_name]
    if missing:
        raise CaptureError(f"the exported graph has inputs the trace does not: {missing}")
    return [by_name[value.name] for value in model.graph.input]
