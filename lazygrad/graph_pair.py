"""One built (signature, mask): its forward and backward ONNX graphs, run on torch tensors.

Knows how to feed each graph (primals, random draws, forward results, cotangents), how to turn
forward results into the module's outputs (views applied in torch), which state the forward
updated, and for which sizes the graphs hold. Sessions are made per device on first use.

A backward cut into segments (`capture/segment.py`) runs them in order; after each, the pair
drops its references to the stashed tensors and passed values no later segment reads, so that
torch frees them while the rest of the backward runs (the caller hands its references over).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from lazygrad.capture import (
    Aliasing,
    Feed,
    Graphs,
    apply_views,
    reshaped_outputs,
    scattered_outputs,
    symbols,
    zero_where,
)
from lazygrad.session import GraphRunError, GraphSession


class ChecksFailed(Exception):
    """An argument check the forward makes (a distribution's `validate_args`) did not hold, or a
    value the trace read as the first call did differs: the call runs again in eager PyTorch,
    which raises the check's own error or reads the other value. Its message: ORT's error, where
    the graph failed before its checks could say so."""


class GraphPair:
    def __init__(
        self, graphs: Graphs, mask: tuple[bool, ...] | None, persistent: int, arena: bool
    ) -> None:
        """`persistent`: how many leading primals are module state (fed every call); `arena`:
        the sessions take CPU memory from ORT's arena (`GraphSession`)."""
        self.graphs = graphs
        self.mask = mask
        self._persistent = persistent
        self._arena = arena
        self._sessions: dict[tuple[str, Hashable], GraphSession] = {}
        self._valid_sizes: dict[tuple[int, ...], bool] = {}
        self._lock = threading.Lock()
        self.outputs_read_by_backward = sorted(
            {feed.index for feed in graphs.backward_feeds if feed.kind == "saved"}
        )
        self.backward_reads_draws = any(feed.kind == "random" for feed in graphs.backward_feeds)
        # Where each graph input sits among the call's values, per count of each kind of value.
        self._positions: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self._root_views = [(slot.index, _views(slot.views)) for slot in graphs.roots]
        self._output_views = [(o.source == "root", o.index, _views(o.views))
                              for o in graphs.outputs]
        self.aliasing = Aliasing(tuple((o.source, o.index) for o in graphs.outputs),
                                 tuple(bool(o.views) for o in graphs.outputs))
        # The roots that get a cotangent: those the outputs of the mask are made from.
        self.root_mask = None if mask is None else self.aliasing.root_mask(mask)
        self._segments = _schedule(graphs) if graphs.backward_segments else []
        # The gradients ORT returns before their last Reshape (capture/reshaped_outputs.py),
        # by position among the backward's outputs.
        backward = graphs.backward
        peeled = reshaped_outputs.unreshaped(backward) if backward is not None else set()
        outputs = [value.name for value in backward.graph.output] if backward is not None else []
        self._unreshaped = {at for at, name in enumerate(outputs) if name in peeled}
        # And those whose additions it returns, by position: (the indices' position, the axis,
        # the gradient's shape, the additions' position; None: the output is the additions, to
        # add into zeros), added here (capture/scattered_outputs.py).
        scattered = scattered_outputs.scattered(backward) if backward is not None else {}
        self._scattered = {}
        for name, (indices, axis, shape, added) in scattered.items():
            self._scattered[outputs.index(name)] = (
                outputs.index(indices), axis, shape,
                None if added is None else outputs.index(added))

    # ---- sizes -------------------------------------------------------------------------------

    def sizes(self, primals: Sequence[torch.Tensor]) -> dict[str, int]:
        return symbols.sizes(primals, self.graphs.locations)

    def holds_for(self, env: dict[str, int]) -> bool:
        """Whether the trace's assumptions on sizes hold for a call with these sizes."""
        key = tuple(env.values())
        found = self._valid_sizes.get(key)
        if found is None:
            found = all(symbols.evaluate(code, env) for code in self.graphs.guards)
            self._valid_sizes[key] = found
        return found

    def sizes_of(self, env: dict[str, int]) -> dict[int, Any] | None:
        """The numbers of the module's result that are sizes, by position among its numbers
        (`outputs.sized_numbers`), for a call with these sizes."""
        if not self.graphs.sized:
            return None
        return {position: symbols.evaluate(code, env) for position, code in self.graphs.sized}

    def draw(self, env: dict[str, int], device: torch.device,
             generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """A step's draws, from `generator` (None: torch's default one on `device`)."""
        return [draw.sample(env, device, generator) for draw in self.graphs.draws]

    # ---- running -----------------------------------------------------------------------------

    def session(self, which: str, device: torch.device, segment: int | None = None) -> GraphSession:
        """The session of the forward or the backward graph (`segment`: of that segment)."""
        key = (which, segment, device if device.type == "cpu" else _device_key(device))
        found = self._sessions.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._sessions.get(key)
            if found is None:
                forward = which == "forward"
                whole = self.graphs.forward if forward else self.graphs.backward
                feeds = self.graphs.forward_feeds if forward else self.graphs.backward_feeds
                state = frozenset(
                    value.name for value, feed in zip(whole.graph.input, feeds)
                    if feed.kind == "primal" and feed.index < self._persistent
                )
                model = whole if segment is None else self.graphs.backward_segments[segment]
                if device.type == "cpu":  # ORT's CPU Where is slow (zero_where.py)
                    model = zero_where.zeros_selected_by_products(model)
                found = self._sessions[key] = GraphSession(
                    model, device, state, self._arena, in_node_order=not forward)
            return found

    def release_this_threads_bindings(self) -> None:
        """Forget this thread's bindings of every session, and the module state they hold."""
        for session in list(self._sessions.values()):
            session.release_this_threads_binding()

    def forward(
        self, primals: Sequence[torch.Tensor], draws: Sequence[torch.Tensor], device: torch.device,
        checked: bool = True,
    ) -> list[torch.Tensor]:
        """The forward graph's results: mutated state, output bases, saved tensors. Raises
        `ChecksFailed` where the forward's checks (of arguments, and of the values the trace
        read as the first call did: `checks.py`) did not all hold, unless not `checked` (the
        build's check, which compares that result as any other). A graph with checks that fails
        in ORT raises `ChecksFailed` too: its ops assume what the checks check (`unique`'s
        inverse indexes as many values as the first call had; a sixth distinct value gathers
        past the fifth), so an error there is data its checks would have refused."""
        session = self.session("forward", device)
        values = [*primals, *draws]
        positions = self._feed_positions("forward", len(primals), len(draws))
        check = self.graphs.check
        try:
            results = session.run(list(map(values.__getitem__, positions)))
        except GraphRunError as error:
            if checked and check is not None:
                raise ChecksFailed(str(error)) from None
            raise
        if checked and check is not None and not bool(results[check]):
            raise ChecksFailed
        return results

    def write_back(self, primals: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
        """Write the state the forward updated (BatchNorm's running statistics) to its tensors."""
        if not self.graphs.mutations:
            return
        with torch.no_grad():
            for result, primal in self.graphs.mutations:
                primals[primal].copy_(results[result])

    def roots(self, results: Sequence[torch.Tensor], env: dict[str, int]) -> list[torch.Tensor]:
        """What the autograd node returns: the roots of the module's outputs (`aliases.py`)."""
        return [
            _apply(views, results[index], env) if views else results[index]
            for index, views in self._root_views
        ]

    def module_outputs(self, roots: Sequence[torch.Tensor], primals: Sequence[torch.Tensor],
                       env: dict[str, int]) -> list[torch.Tensor]:
        """The module's flat outputs, made from the roots (and primals) by views in torch:
        outside the autograd node, so that autograd sums their gradients into the roots'."""
        return [
            _apply(views, (roots if of_root else primals)[index], env)
            for of_root, index, views in self._output_views
        ]

    def roots_in_mask(
        self, results: Sequence[torch.Tensor | None], env: dict[str, int]
    ) -> list[torch.Tensor | None]:
        """The roots this pair's mask gives a cotangent; None for the others, whose results
        may already be gone."""
        assert self.root_mask is not None
        return [
            _apply(views, results[index], env) if wanted else None
            for (index, views), wanted in zip(self._root_views, self.root_mask)
        ]

    def backward(
        self,
        primals: Sequence[torch.Tensor],
        draws: list[torch.Tensor],
        results: list[torch.Tensor | None],
        cotangents: Sequence[torch.Tensor | None],
        device: torch.device,
    ) -> list[torch.Tensor | None]:
        """A gradient per primal (None where no masked output reaches it).

        `draws` and `results` are handed over: the lists are emptied, and a segmented backward
        drops each of their tensors once no later segment reads it."""
        values = [
            *primals, *draws, *results,
            *(None if grad is None else grad.contiguous() for grad in cotangents),
        ]
        positions = self._feed_positions(
            "backward", len(primals), len(draws), len(results), len(cotangents)
        )
        draws.clear()
        results.clear()
        inputs = list(map(values.__getitem__, positions))
        del values
        if self._segments:
            outputs = self._run_segments(inputs, device)
        else:
            outputs = self.session("backward", device).run(inputs)
        grads: list[torch.Tensor | None] = [None] * len(primals)
        for position, (index, grad) in enumerate(zip(self.graphs.grads_for, outputs)):
            if position in self._scattered:  # its additions returned: added here
                indices, axis, shape, added = self._scattered[position]
                if added is None:
                    grad = grad.new_zeros(shape).scatter_add_(axis, outputs[indices], grad)
                else:
                    grad.scatter_add_(axis, outputs[indices], outputs[added])
            elif position in self._unreshaped:  # returned before its Reshape: viewed here
                grad = grad.view(primals[index].shape)
            grads[index] = grad
        return grads

    def _run_segments(self, inputs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """The backward's outputs, its segments run in order; `inputs` (the whole graph's, in
        its order) is emptied, and each value is dropped after the last segment that reads it."""
        names = [value.name for value in self.graphs.backward.graph.input]
        live = dict(zip(names, inputs))
        inputs.clear()
        for index, (reads, makes, done) in enumerate(self._segments):
            made = self.session("backward", device, index).run(list(map(live.__getitem__, reads)))
            live.update(zip(makes, made))
            del made
            for name in done:
                del live[name]
        return [live[value.name] for value in self.graphs.backward.graph.output]

    def _feed_positions(self, which: str, *counts: int) -> list[int]:
        """Where each input of the `which` graph sits in the concatenated values it is fed
        (primals, draws, then for the backward the forward results and the cotangents, with
        `counts` values of each kind)."""
        found = self._positions.get((which, counts))
        if found is None:
            feeds = self.graphs.forward_feeds if which == "forward" else self.graphs.backward_feeds
            found = self._positions[(which, counts)] = _positions(feeds, counts)
        return found

    def unreached(self, root_mask: Sequence[bool]) -> set[int]:
        """Primals whose gradient no root of `root_mask` reaches (eager leaves them None)."""
        return {
            primal for primal, reach in zip(self.graphs.grads_for, self.graphs.grad_reach)
            if not any(root_mask[i] for i in reach)
        }


_KINDS = ("primal", "random", "saved", "cotangent")

# One segment of a backward: the names it reads, the names it makes, the names no later segment
# reads (nor the backward returns): dropped once it has run.
_Segment = tuple[list[str], list[str], list[str]]


def _schedule(graphs: Graphs) -> list[_Segment]:
    """Each segment's reads, makes and drops; the first also drops the inputs no segment reads."""
    wanted = {value.name for value in graphs.backward.graph.output}
    segments = [
        ([value.name for value in model.graph.input], [value.name for value in model.graph.output])
        for model in graphs.backward_segments
    ]
    unread = {value.name for value in graphs.backward.graph.input} - wanted - {
        name for reads, _ in segments for name in reads
    }
    schedule: list[_Segment] = []
    for index, (reads, makes) in enumerate(segments):
        later = {name for reads_later, _ in segments[index + 1:] for name in reads_later}
        done = (set(reads) | set(makes) | (unread if index == 0 else set())) - later - wanted
        schedule.append((reads, makes, sorted(done)))
    return schedule


def _positions(feeds: Sequence[Feed], counts: tuple[int, ...]) -> list[int]:
    offsets = dict(zip(_KINDS, itertools.accumulate(counts, initial=0)))
    return [offsets[feed.kind] + feed.index for feed in feeds]


# One view of an output's chain, resolved once: (view op, args, the step itself where its
# arguments hold size expressions, evaluated per call by `apply_views`; None otherwise).
_View = tuple[Callable[..., torch.Tensor], list[Any], tuple[str, list[Any]] | None]


def _views(steps: list[tuple[str, list[Any]]]) -> list[_View]:
    resolved: list[_View] = []
    for name, args in steps:
        namespace, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
        sized = any(isinstance(leaf, dict) for leaf in _leaves(args))
        resolved.append((op, args, (name, args) if sized else None))
    return resolved


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _apply(views: list[_View], base: torch.Tensor, env: dict[str, int]) -> torch.Tensor:
    """An output's views applied in torch; a view whose arguments hold sizes is applied by
    `apply_views`, which evaluates them on this call's `env`."""
    current = base
    for op, args, sized in views:
        current = apply_views([sized], current, env) if sized else op(current, *args)
    return current


def _device_key(device: torch.device) -> Hashable:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return ("cuda", index, torch.cuda.current_stream(index).cuda_stream)
    return (device.type, device.index)
