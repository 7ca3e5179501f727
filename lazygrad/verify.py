"""Every newly built pair of graphs is checked once, against its own FX graphs run in torch.

The exporter's translations are not PyTorch: a translation bug (torchlib once made
`nll_loss_forward`'s total_weight a constant, and gradients came out 32x too large) would train
silently wrong. So before a pair serves a step, its forward and backward run in ONNX Runtime
and, as FX graphs, in torch, on the call's real inputs (and the step's real cotangents where
known); a mismatch raises, and the runtime falls back with the reason. A backward cut into
segments is checked as it runs: segment after segment, against the whole FX backward.

ORT and torch round differently, so a result is compared within a tolerance. Some results are
rounding noise in both (a gradient that is zero in exact arithmetic, such as a LayerNorm'd
sum's gradient of what feeds the norm, of magnitude 1e-5 where others reach 1), or the end of
a long chain of roundings (a late activation of a deep CNN with batch statistics): no
tolerance fits them without hiding real errors elsewhere, and the model ran in parts, or
eagerly, for nothing. A result beyond the tolerance is therefore judged against a float64 run
of the same FX graphs, as torch's own accuracy checks judge compiled code (`fp64_ref` in
`torch._dynamo.utils.same`): ORT's error must be within a few times torch's own float32 error.
A translation bug is far beyond that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from lazygrad import generators, heap, ties
from lazygrad.capture import Captured, Feed, open_order
from lazygrad.eager_record import EagerRecord, sample
from lazygrad.graph_pair import ChecksFailed, GraphPair


class VerificationError(RuntimeError):
    """The ONNX graphs do not compute what their FX graphs compute."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(relative to the largest magnitude, absolute): ORT and torch reduce in different orders,
    and a value that is zero in exact arithmetic (the gradient of a bias before a BatchNorm)
    comes out as rounding noise in both. Float64's is float64's: a float64 graph that computes
    anything in float32 (a constant, a kernel) is 1e-8 off, which float32's tolerance hid."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2, 1e-3
    return (1e-9, 1e-11) if dtype == torch.float64 else (1e-3, 1e-5)


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
    # From a copy of torch's generator, as every draw of the builder thread (`generators.py`).
    found = generators.state(device)
    draws = pair.draw(env, device, generators.copy_of(device, found))
    values: dict[str, Sequence] = {"primal": primals, "random": draws}
    # ORT's forward results first, then torch's FX forward, compared result by result as torch
    # makes them: a result torch no longer needs is freed, and ORT's once compared, unless the
    # backward's check reads it (fed ORT's) or it is an output that gets a cotangent. One set
    # of forward results is alive, not two.
    # Its draws are not the call's: a branch on them (LayerDrop's) may go the other way, which
    # the graph's check result says, compared with torch's as any other result.
    results: list = pair.forward(primals, draws, device, checked=False)
    checking = tidy.backward is not None and pair.mask is not None
    read = set(pair.outputs_read_by_backward)
    kept: set[int] = set()
    if checking:
        kept = read | {slot.index for slot, wanted in zip(pair.graphs.roots, pair.root_mask)
                       if wanted}
    suspects = _Suspects()
    forward_inputs = _feeds(tidy.forward_feeds, values)
    with torch.no_grad():
        _ForwardCheck(tidy.forward, results, kept, suspects).run(*forward_inputs)
        suspects.judge(functools.partial(_Float64(tidy.forward).run, *forward_inputs))
    del forward_inputs
    heap.release_freed_memory()
    if not checking:
        _order_does_not_matter(captured, pair, primals, env, device, found, None)
        return
    outputs = pair.roots_in_mask(results, env)
    if cotangents is None:
        drawing = generators.copy_of(device, found)
        cotangents = [
            torch.randn(o.shape, dtype=o.dtype, device=o.device, generator=drawing)
            if o is not None and o.is_floating_point() else None
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
        suspects.compare(index, actual, wanted, f"gradient {index}")
    del expected_grads

    def float64_backward() -> Sequence[torch.Tensor]:
        """The backward on a float64 forward's results (ORT's were handed over)."""
        draws = pair.draw(env, device, generators.copy_of(device, found))  # the same draws
        values = {"primal": primals, "random": draws, "cotangent": cotangents}
        values["saved"] = _Float64(tidy.forward).run(*_feeds(tidy.forward_feeds, values))
        return _Float64(tidy.backward).run(*_feeds(tidy.backward_feeds, values))

    with torch.no_grad():
        suspects.judge(float64_backward)
    _order_does_not_matter(captured, pair, primals, env, device, found, cotangents)


def _order_does_not_matter(
    captured: Captured, pair: GraphPair, primals: Sequence[torch.Tensor], env: dict[str, int],
    device: torch.device, found: torch.Tensor,
    cotangents: Sequence[torch.Tensor | None] | None,
) -> None:
    """Raise VerificationError if what the FX graphs return (the module's results, the state
    they update, and the gradients for `cotangents` where given) changes when each top-k whose
    order eager's kernel chooses (`open_order.py`) gives its picks in another order: the graph
    takes them sorted, eager in its kernel's order, so the result must not depend on it."""
    forward_picks, backward_picks = captured.open_order
    if not forward_picks and not backward_picks:
        return
    tidy = captured.tidy
    returned = [slot.index for slot in pair.graphs.roots]
    returned += [result for result, _ in pair.graphs.mutations]
    runs = []
    for picks in (({}, {}), (forward_picks, backward_picks)):
        draws = pair.draw(env, device, generators.copy_of(device, found))  # the same draws
        values: dict[str, Sequence] = {"primal": primals, "random": draws}
        with torch.no_grad():
            results = list(_Rotating(tidy.forward, picks[0]).run(
                *_feeds(tidy.forward_feeds, values)))
            grads = [] if cotangents is None else list(_Rotating(tidy.backward, picks[1]).run(
                *_feeds(tidy.backward_feeds,
                        {**values, "saved": results, "cotangent": cotangents})))
        runs.append(([results[index] for index in returned], grads))
        del results
    (results, grads), (turned_results, turned_grads) = runs
    pairs = [*zip(turned_results, results, (f"output {i}" for i in returned)),
             *zip(turned_grads, grads, (f"gradient {i}" for i in range(len(grads))))]
    for turned, plain, what in pairs:
        try:
            message = _mismatch(turned, plain, what,
                                names=("a run with the picks in another order", "the sorted run"))
        except VerificationError as error:
            message = str(error)
        if message is not None:
            raise VerificationError(
                "its result depends on the order of a `topk(sorted=False)`'s picks, which "
                f"eager's kernel chooses and the graph cannot reproduce ({message}); pass "
                "sorted=True where the order does not matter")


def verify_like_eager(pair: GraphPair, primals: Sequence[torch.Tensor], eager: EagerRecord,
                      device: torch.device) -> None:
    """Raise VerificationError unless the graphs' forward returns, on the call that eager
    PyTorch ran and with the draws it drew, what eager returned (`eager_record.py`).

    `verify` holds ORT to the trace; this holds the trace to the module."""
    primals = [p.detach() for p in eager.primals(primals)]
    env = pair.sizes(primals)
    draws = pair.draw(env, device, eager.generator(device))
    try:
        results = pair.forward(primals, draws, device)
    except ChecksFailed as failed:
        raise VerificationError(
            "the graph's checks do not hold on the call eager PyTorch ran, with its draws: the "
            "trace read a value otherwise than that call did (a branch, a number)"
            + (f"; ORT: {failed}" if str(failed) else "")) from None
    outputs = pair.module_outputs(pair.roots(results, env), primals, env)
    if len(outputs) != len(eager.samples):
        raise VerificationError(
            f"the graph returns {len(outputs)} tensors, eager PyTorch {len(eager.samples)}")
    for index, (actual, wanted) in enumerate(zip(outputs, eager.samples)):
        try:
            _compare(sample(actual), wanted, f"output {index}")
        except VerificationError as error:
            raise VerificationError(
                f"the traced graph does not compute what the module computes when it runs ("
                f"{error}; eager PyTorch's output on the same call, with the same draws): its "
                "code takes another path under tracing, such as a fast path for inference, or "
                "an op whose order eager's kernel chooses (`topk(sorted=False)`) reaches an "
                "order-dependent result") from None


class _Reshaping(fx.Interpreter):
    """Runs an FX graph with every `view` as a `reshape`: the same values, whatever the layout
    of the tensors it is given (a gradient that came through a transpose, or a contiguous one
    for a permuted output, made torch's view fail where ORT, which has no layouts, ran)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.view.default:
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)


class _Rotating(_Reshaping):
    """Runs an FX graph with the picks of its top-k nodes named in `picks` (name -> dimension)
    each moved one place along their dimension (`open_order.rotated`)."""

    def __init__(self, module: fx.GraphModule, picks: dict[str, int]) -> None:
        super().__init__(module)
        self._picks = picks

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        dim = self._picks.get(node.name)
        return result if dim is None else open_order.rotated(result, dim)


class _Float64(_Reshaping):
    """Runs an FX graph in float64: every floating-point tensor it is given or makes, and every
    floating-point dtype it names (a cast, a factory), is float64."""

    def run_node(self, node: fx.Node) -> Any:
        return pytree.tree_map(_wider, super().run_node(node))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map(_wider, (args, kwargs))
        return super().call_function(target, args, kwargs)


def _wider(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    return value


class _Suspects:
    """Results beyond `tolerance`, ORT's and torch's, held until `judge` runs their graph in
    float64 (only then: most checks have none)."""

    _MULTIPLE = 3  # ORT's error may be this many times torch's own (torch's checks use 2 or 3)

    def __init__(self) -> None:
        self._found: list[tuple[int, torch.Tensor, torch.Tensor, str]] = []

    def compare(self, position: int, actual: torch.Tensor, wanted: object, what: str,
                pick: ties.Picker | None = None) -> None:
        """Compare result `position` (ORT's `actual`, torch's `wanted`, a selection's indices
        where `pick` gives the values they pick): raise on a mismatch of shape, dtype, NaNs or
        exact values; hold a difference beyond the tolerance."""
        message = _mismatch(actual, wanted, what, pick)
        if message is not None:
            assert isinstance(wanted, torch.Tensor)
            self._found.append((position, actual, wanted, message))

    def judge(self, reference: Callable[[], Sequence[Any]]) -> None:
        """Raise VerificationError unless each result held is, against `reference()` (the
        graph's results in float64), within `_MULTIPLE` times torch's float32 error plus the
        absolute tolerance."""
        if not self._found:
            return
        found, self._found = self._found, []
        try:
            truths = reference()
        except Exception as error:  # an op without a float64 kernel: no judge, no pass
            raise VerificationError(found[0][3]) from error
        for position, actual, wanted, message in found:
            truth = truths[position]
            ort_error = _difference(actual.double(), truth)[0]
            torch_error = _difference(wanted.double(), truth)[0]
            if not ort_error <= self._MULTIPLE * torch_error + tolerance(wanted.dtype)[1]:
                raise VerificationError(
                    f"{message}; against float64, ORT is off by {ort_error:.3g}, torch by "
                    f"{torch_error:.3g}")


class _ForwardCheck(fx.Interpreter):
    """Runs an FX forward graph in torch, comparing each result with ORT's (`got`, in the graph's
    output order) as soon as it is made, into `suspects`; ORT's is then dropped from `got`
    unless its index is in `kept`. Torch's values are freed after their last use by another
    node (the graph run has no output node to keep them)."""

    def __init__(self, module: fx.GraphModule, got: list, kept: set[int],
                 suspects: _Suspects) -> None:
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
        self._got, self._kept, self._suspects = got, kept, suspects
        # Compared indices -> their selection, whose input is held until they are (`ties`).
        self._chosen = {node: chosen for node in self._positions
                        if (chosen := ties.selection(node)) is not None}
        self._selected = set(self._chosen.values())
        self._sources: dict[fx.Node, torch.Tensor] = {}
        super().__init__(module, graph=graph)

    def run_node(self, node: fx.Node) -> object:
        if node in self._selected:
            self._sources[node] = self.env[node.args[0]]
        value = super().run_node(node)
        chosen = self._chosen.get(node)
        source = self._sources.pop(chosen, None)
        pick = None if source is None else ties.picker(chosen, source)
        for position in self._positions.get(node, ()):
            actual = self._got[position]
            if position not in self._kept:
                self._got[position] = None
            self._suspects.compare(position, actual, value, f"forward result {position}", pick)
        return value if node.users else None


def _feeds(feeds: list[Feed], values: dict[str, Sequence]) -> list[torch.Tensor]:
    return [values[feed.kind][feed.index] for feed in feeds]


def _compare(actual: torch.Tensor, wanted: object, what: str) -> None:
    """Raise unless `actual` (ORT's) equals `wanted` (torch's) within `tolerance`."""
    message = _mismatch(actual, wanted, what)
    if message is not None:
        raise VerificationError(message)


def _mismatch(actual: torch.Tensor, wanted: object, what: str,
              pick: ties.Picker | None = None,
              names: tuple[str, str] = ("ORT", "torch")) -> str | None:
    """How `actual` (ORT's) differs from `wanted` (torch's) beyond `tolerance`, or None; raise
    where no rounding explains it (a shape, a dtype, NaNs elsewhere, an integer). A value that is
    not a tensor in torch (a size the backward reads) is not compared. A selection's indices
    (`pick` gives the values they pick) may differ where the values they pick are equal within
    the tolerance: a near tie, which rounding orders either way. `names` says whose the two
    runs are in the message."""
    if not isinstance(wanted, torch.Tensor):
        return None
    mine, theirs = names
    if actual.shape != wanted.shape or actual.dtype != wanted.dtype:
        raise VerificationError(
            f"{what}: {mine} gives {actual.dtype}{list(actual.shape)}, {theirs} "
            f"{wanted.dtype}{list(wanted.shape)}"
        )
    if wanted.is_complex():  # compared as their real and imaginary parts, rounding as theirs
        actual, wanted = torch.view_as_real(actual.resolve_conj()), torch.view_as_real(
            wanted.resolve_conj())
    if not wanted.is_floating_point():
        if not torch.equal(actual, wanted) and not (
                pick is not None and _same_picks(actual, wanted, pick, what)):
            raise VerificationError(f"{what}: {mine} and {theirs} differ")
        return None
    error, scale, same_nans = _difference(actual, wanted)
    if not same_nans:
        raise VerificationError(f"{what}: {mine} and {theirs} have NaNs in different places")
    relative, absolute = tolerance(wanted.dtype)
    if error > relative * scale + absolute:
        return (f"{what}: {mine} differs from {theirs} by {error:.3g} "
                f"(largest magnitude {scale:.3g})")
    return None


def _same_picks(actual: torch.Tensor, wanted: torch.Tensor, pick: ties.Picker,
                what: str) -> bool:
    """Whether indices `actual` (ORT's) pick what `wanted` (torch's) pick, within `tolerance`.
    An exact tie in torch's values may be none in ORT's (a window of ReLU's zeros where ORT's
    BatchNorm left one a rounding above 0), so the first of a tie is not asked for here; that
    ORT's kernels take the first of an exact tie, as torch's do, is a test's
    (`tests/test_verify.py`)."""
    try:
        picked = pick(actual)
    except (RuntimeError, IndexError):  # an index out of range
        return False
    return _mismatch(picked, pick(wanted), what) is None


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
