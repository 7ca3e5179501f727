"""One built (signature, mask): its forward and backward ONNX graphs, run on torch tensors.

Knows how to feed each graph (primals, random draws, forward results, cotangents), how to turn
forward results into the module's outputs (views applied in torch), which state the forward
updated, and for which sizes the graphs hold. Sessions are made per device on first use.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from lazygrad.capture import Feed, Graphs, apply_views, symbols
from lazygrad.session import GraphSession


class GraphPair:
    def __init__(self, graphs: Graphs, mask: tuple[bool, ...] | None, persistent: int) -> None:
        """`persistent`: how many leading primals are module state (fed every call)."""
        self.graphs = graphs
        self.mask = mask
        self._persistent = persistent
        self._sessions: dict[tuple[str, Hashable], GraphSession] = {}
        self._valid_sizes: dict[tuple[int, ...], bool] = {}
        self._lock = threading.Lock()
        self.outputs_read_by_backward = sorted(
            {feed.index for feed in graphs.backward_feeds if feed.kind == "saved"}
        )
        # Where each graph input sits among the call's values, per count of each kind of value.
        self._positions: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self._output_views = [(slot.index, _views(slot.views)) for slot in graphs.outputs]

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

    def draw(self, env: dict[str, int], device: torch.device) -> list[torch.Tensor]:
        return [draw.sample(env, device) for draw in self.graphs.draws]

    # ---- running -----------------------------------------------------------------------------

    def session(self, which: str, device: torch.device) -> GraphSession:
        key = (which, device if device.type == "cpu" else _device_key(device))
        found = self._sessions.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._sessions.get(key)
            if found is None:
                forward = which == "forward"
                model = self.graphs.forward if forward else self.graphs.backward
                feeds = self.graphs.forward_feeds if forward else self.graphs.backward_feeds
                persistent = frozenset(
                    value.name for value, feed in zip(model.graph.input, feeds)
                    if feed.kind == "primal" and feed.index < self._persistent
                )
                found = self._sessions[key] = GraphSession(
                    model, device, persistent, arena=not forward
                )
            return found

    def forward(
        self, primals: Sequence[torch.Tensor], draws: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """The forward graph's results: mutated state, output bases, saved tensors."""
        session = self.session("forward", device)
        values = [*primals, *draws]
        positions = self._feed_positions("forward", len(primals), len(draws))
        return session.run(list(map(values.__getitem__, positions)))

    def write_back(self, primals: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
        """Write the state the forward updated (BatchNorm's running statistics) to its tensors."""
        if not self.graphs.mutations:
            return
        with torch.no_grad():
            for result, primal in self.graphs.mutations:
                primals[primal].copy_(results[result])

    def outputs(self, results: Sequence[torch.Tensor], env: dict[str, int]) -> list[torch.Tensor]:
        return [
            _apply(views, results[index], env) if views else results[index]
            for index, views in self._output_views
        ]

    def backward(
        self,
        primals: Sequence[torch.Tensor],
        draws: Sequence[torch.Tensor],
        results: Sequence[torch.Tensor | None],
        cotangents: Sequence[torch.Tensor | None],
        device: torch.device,
    ) -> list[torch.Tensor | None]:
        """A gradient per primal (None where no masked output reaches it)."""
        session = self.session("backward", device)
        values = [
            *primals, *draws, *results,
            *(None if grad is None else grad.contiguous() for grad in cotangents),
        ]
        positions = self._feed_positions(
            "backward", len(primals), len(draws), len(results), len(cotangents)
        )
        grads: list[torch.Tensor | None] = [None] * len(primals)
        for index, grad in zip(
            self.graphs.grads_for, session.run(list(map(values.__getitem__, positions)))
        ):
            grads[index] = grad
        return grads

    def _feed_positions(self, which: str, *counts: int) -> list[int]:
        """Where each input of the `which` graph sits in the concatenated values it is fed
        (primals, draws, then for the backward the forward results and the cotangents, with
        `counts` values of each kind)."""
        found = self._positions.get((which, counts))
        if found is None:
            feeds = self.graphs.forward_feeds if which == "forward" else self.graphs.backward_feeds
            found = self._positions[(which, counts)] = _positions(feeds, counts)
        return found

    def unreached(self, mask: Sequence[bool]) -> set[int]:
        """Primals whose gradient no output of `mask` reaches (eager leaves them None)."""
        return {
            primal for primal, reach in zip(self.graphs.grads_for, self.graphs.grad_reach)
            if not any(mask[i] for i in reach)
        }


_KINDS = ("primal", "random", "saved", "cotangent")


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
