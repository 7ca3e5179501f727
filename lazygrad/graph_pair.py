"""One built (signature, mask): its forward and backward ONNX graphs, run on torch tensors.

Knows how to feed each graph (primals, random draws, forward results, cotangents), how to turn
forward results into the module's outputs (views applied in torch), which state the forward
updated, and for which sizes the graphs hold. Sessions are made per device on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import torch

from lazygrad.capture import Graphs, apply_views, symbols
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
        self.outputs_read_by_backward = {
            feed.index for feed in graphs.backward_feeds if feed.kind == "saved"
        }

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
        key = (which, _device_key(device))
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
                found = self._sessions[key] = GraphSession(model, device, persistent)
            return found

    def forward(
        self, primals: Sequence[torch.Tensor], draws: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """The forward graph's results: mutated state, output bases, saved tensors."""
        session = self.session("forward", device)
        values = {"primal": primals, "random": draws}
        feeds = {
            name: values[feed.kind][feed.index]
            for name, feed in zip(session.input_names, self.graphs.forward_feeds)
        }
        return session.run(feeds)

    def outputs(self, results: Sequence[torch.Tensor], env: dict[str, int]) -> list[torch.Tensor]:
        return [
            apply_views(slot.views, results[slot.index], env) if slot.views
            else results[slot.index]
            for slot in self.graphs.outputs
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
        values = {"primal": primals, "random": draws, "saved": results, "cotangent": cotangents}
        feeds = {}
        for name, feed in zip(session.input_names, self.graphs.backward_feeds):
            value = values[feed.kind][feed.index]
            feeds[name] = value.contiguous() if feed.kind == "cotangent" else value
        grads: list[torch.Tensor | None] = [None] * len(primals)
        for index, grad in zip(self.graphs.grads_for, session.run(feeds)):
            grads[index] = grad
        return grads

    def unreached(self, mask: Sequence[bool]) -> set[int]:
        """Primals whose gradient no output of `mask` reaches (eager leaves them None)."""
        return {
            primal for primal, reach in zip(self.graphs.grads_for, self.graphs.grad_reach)
            if not any(mask[i] for i in reach)
        }


def _device_key(device: torch.device) -> Hashable:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return ("cuda", index, torch.cuda.current_stream(index).cuda_stream)
    return (device.type, device.index)
