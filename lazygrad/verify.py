"""Every newly built pair of graphs is checked once, against its own FX graphs run in torch.

The exporter's translations are not PyTorch: a translation bug (torchlib once made
`nll_loss_forward`'s total_weight a constant, and gradients came out 32x too large) would train
silently wrong. So before a pair serves a step, its forward and backward run in ONNX Runtime
and, as FX graphs, in torch, on the call's real inputs (and the step's real cotangents where
known); a mismatch raises, and the runtime falls back with the reason. A backward cut into
segments is checked as it runs: segment after segment, against the whole FX backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from lazygrad import heap
from lazygrad.capture import Captured, Feed
from lazygrad.graph_pair import GraphPair


class VerificationError(RuntimeError):
    """The ONNX graphs do not compute what their FX graphs compute."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(relative to the largest magnitude, absolute): ORT and torch reduce in different orders,
    and a value that is zero in exact arithmetic (the gradient of a bias before a BatchNorm)
    comes out as rounding noise in both."""
    return (1e-2, 1e-3) if dtype in (torch.float16, torch.bfloat16) else (1e-3, 1e-5)


def verify(
    captured: Captured,
    pair: GraphPair,
    primals: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor | None] | None,
    device: torch.device,
) -> None:
    """Raise VerificationError unless ORT's results equal the FX graphs' on these inputs."""
    # The check runs between two steps (turns.py): the last step's freed pages go back first,
    # or ORT's forward results land beside them.
    heap.release_freed_memory()
    tidy = captured.tidy
    primals = [p.detach() for p in primals]
    env = pair.sizes(primals)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        draws = pair.draw(env, device)
    values: dict[str, Sequence] = {"primal": primals, "random": draws}
    # ORT's forward results first, then torch's FX forward, compared result by result as torch
    # makes them: a result torch no longer needs is freed, and ORT's once compared, unless the
    # backward's check reads it (fed ORT's) or it is an output that gets a cotangent. One set
    # of forward results is alive, not two.
    results: list = pair.forward(primals, draws, device)
    checking = tidy.backward is not None and pair.mask is not None
    read = set(pair.outputs_read_by_backward)
    kept: set[int] = set()
    if checking:
        kept = read | {slot.index for slot, wanted in zip(pair.graphs.roots, pair.root_mask)
                       if wanted}
    with torch.no_grad():
        _ForwardCheck(tidy.forward, results, kept).run(*_feeds(tidy.forward_feeds, values))
    heap.release_freed_memory()
    if not checking:
        return
    outputs = pair.roots_in_mask(results, env)
    if cotangents is None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            cotangents = [
                torch.randn_like(o) if o is not None and o.is_floating_point() else None
                for o in outputs
            ]
    # Contiguous, as ORT is fed them. The trace's had its outputs' layouts, which a view in
    # the FX backward may rely on: torch runs it with views as reshapes (`_Reshaping`).
    cotangents = [
        (c.detach().contiguous() if c is not None else torch.zeros_like(o))
        if o is not None else None
        for c, o in zip(cotangents, outputs)
    ]
    # Only what the backward reads stays.
    del outputs
    results = [tensor if index in read else None for index, tensor in enumerate(results)]
    values = {**values, "saved": results, "cotangent": cotangents}
    with torch.no_grad():
        expected_grads = list(_Reshaping(tidy.backward).run(*_feeds(tidy.backward_feeds, values)))
    heap.release_freed_memory()  # torch's backward freed: ORT's allocations get it back
    grads = pair.backward(primals, draws, results, cotangents, device)
    del values, results
    gradients = [grads[i] for i in pair.graphs.grads_for]
    if len(gradients) != len(expected_grads):
        raise VerificationError(
            f"{len(gradients)} gradients from ORT, {len(expected_grads)} from torch"
        )
    for index, wanted in enumerate(expected_grads):
        actual, gradients[index] = gradients[index], None
        _compare(actual, wanted, f"gradient {index}")


def verify_like_eager(
    pair: GraphPair,
    primals: Sequence[torch.Tensor],
    eager_outputs: Sequence[torch.Tensor],
    device: torch.device,
) -> None:
    """Raise VerificationError unless the inference graph returns, on the call that eager
    PyTorch ran, what eager returned.

    `verify` holds ORT to the trace; this holds the trace to the module. A module whose code
    takes another path when traced than when run computes something else: nn.TransformerEncoder
    under no_grad runs a nested-tensor fast path that zeroes padded positions, which a trace
    cannot take, and its graph returned other values there. A graph with random draws is not
    compared (its draws are not eager's)."""
    if pair.graphs.draws:
        return
    primals = [p.detach() for p in primals]
    env = pair.sizes(primals)
    outputs = pair.module_outputs(pair.roots(pair.forward(primals, [], device), env), primals,
                                  env)
    if len(outputs) != len(eager_outputs):
        raise VerificationError(
            f"the graph returns {len(outputs)} tensors, eager PyTorch {len(eager_outputs)}")
    for index, (actual, wanted) in enumerate(zip(outputs, eager_outputs)):
        try:
            _compare(actual, wanted.detach(), f"output {index}")
        except VerificationError as error:
            raise VerificationError(
                f"the traced graph does not compute what the module computes when it runs ("
                f"{error}; eager PyTorch's output on the same call): its code takes another "
                f"path under tracing, such as a fast path for inference") from None


class _Reshaping(fx.Interpreter):
    """Runs an FX graph with every `view` as a `reshape`: the same values, whatever the layout
    of the tensors it is given (a gradient that came through a transpose, or a contiguous one
    for a permuted output, made torch's view fail where ORT, which has no layouts, ran)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.view.default:
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)


class _ForwardCheck(fx.Interpreter):
    """Runs an FX forward graph in torch, comparing each result with ORT's (`got`, in the graph's
    output order) as soon as it is made; ORT's is then dropped from `got` unless its index is in
    `kept`. Torch's values are freed after their last use by another node (the graph run has no
    output node to keep them)."""

    def __init__(self, module: fx.GraphModule, got: list, kept: set[int]) -> None:
        copies: dict[fx.Node, fx.Node] = {}
        graph = fx.Graph()
        results = graph.graph_copy(module.graph, copies)
        graph.output(())
        if len(got) != len(results):
            raise VerificationError(
                f"{len(got)} forward results from ORT, {len(results)} from torch"
            )
        self._positions: dict[fx.Node, list[int]] = {}
        for position, result in enumerate(results):
            if isinstance(result, fx.Node):
                self._positions.setdefault(result, []).append(position)
        self._got, self._kept = got, kept
        super().__init__(module, graph=graph)

    def run_node(self, node: fx.Node) -> object:
        value = super().run_node(node)
        for position in self._positions.get(node, ()):
            actual = self._got[position]
            if position not in self._kept:
                self._got[position] = None
            _compare(actual, value, f"forward result {position}")
        return value if node.users else None


def _feeds(feeds: list[Feed], values: dict[str, Sequence]) -> list[torch.Tensor]:
    return [values[feed.kind][feed.index] for feed in feeds]


def _compare(actual: torch.Tensor, wanted: object, what: str) -> None:
    """Raise unless `actual` (ORT's) equals `wanted` (torch's) within `tolerance`; a value
    that is not a tensor in torch (a size the backward reads) is not compared."""
    if not isinstance(wanted, torch.Tensor):
        return
    if actual.shape != wanted.shape or actual.dtype != wanted.dtype:
        raise VerificationError(
            f"{what}: ORT gives {actual.dtype}{list(actual.shape)}, torch "
            f"{wanted.dtype}{list(wanted.shape)}"
        )
    if not wanted.is_floating_point():
        if not torch.equal(actual, wanted):
            raise VerificationError(f"{what}: ORT and torch differ")
        return
    error, scale, same_nans = _difference(actual, wanted)
    relative, absolute = tolerance(wanted.dtype)
    if not same_nans or error > relative * scale + absolute:
        raise VerificationError(
            f"{what}: ORT differs from torch by {error:.3g} (largest magnitude {scale:.3g})"
        )


_BLOCK = 1 << 20  # elements compared at once: a logits-sized result makes no full-size temporary


def _difference(actual: torch.Tensor, wanted: torch.Tensor) -> tuple[float, float, bool]:
    """(largest |actual - wanted| where neither is NaN, largest finite |wanted|, NaNs at the
    same places), a block at a time."""
    actual, wanted = actual.reshape(-1), wanted.reshape(-1)
    error, scale, same_nans = 0.0, 0.0, True
    for start in range(0, wanted.numel(), _BLOCK):
        got, want = actual[start:start + _BLOCK], wanted[start:start + _BLOCK]
        same_nans = same_nans and torch.isnan(got).equal(torch.isnan(want))
        differences = (got - want).abs_().nan_to_num_(nan=0.0, posinf=float("inf"))
        error = max(error, differences.max().item())
        scale = max(scale, want.abs().nan_to_num_(nan=0.0, posinf=0.0).max().item())
    return error, scale, same_nans
