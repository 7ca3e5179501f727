"""One call of a lazy module that records autograd: its forward, then maybe its backward.

The runtime decides which graphs serve the step (signature, stash plan, backward for the mask);
the step runs them, in the order `LazyFunction` calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lazygrad import stash as stash_graphs

if TYPE_CHECKING:
    from lazygrad.runtime import Runtime, SignatureEntry
    from lazygrad.signature import Signature


class Step:
    def __init__(
        self,
        runtime: Runtime,
        signature: Signature,
        entry: SignatureEntry,
        device: torch.device,
    ) -> None:
        self.runtime = runtime
        self.signature = signature
        self.entry = entry
        self.device = device
        self.differentiable = entry.differentiable
        self.stash: tuple[str, ...] = ()

    def forward(
        self, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the forward graph that also returns the planned stash; save inputs and stash."""
        runtime, entry = self.runtime, self.entry
        self.stash = planned = runtime.plan_stash(self.signature, entry)
        session = runtime.session(
            entry.sessions,
            ("forward", planned),
            lambda: stash_graphs.forward_graph(entry, planned),
            self.device,
            entry,
        )
        results = session.run(dict(zip(entry.exported.graph_inputs, inputs)))
        produced = dict(zip(session.output_names, results))
        outputs = results[: len(entry.exported.graph_outputs)]
        return outputs, [*inputs, *(produced[name] for name in planned)]

    def backward(
        self, saved: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """Gradients of the graph inputs, from the backward graph of this step's grad mask."""
        runtime, entry = self.runtime, self.entry
        names = entry.exported.graph_inputs
        mask = tuple(g is not None for g in grads)
        if not any(mask):
            return [None] * len(names)
        backward = runtime.backward_entry(self.signature, entry, mask, count=True)
        entry.prediction = mask
        values = dict(zip([*names, *self.stash], saved))
        missing = tuple(name for name in backward.graph.reads if name not in values)
        if missing:
            values.update(self._recompute(values, missing))
        feeds = {name: values[name] for name in backward.graph.reads}
        outputs = entry.exported.graph_outputs
        for grad_name, output in zip(backward.graph.grad_input_names, backward.graph.grad_of):
            feeds[grad_name] = grads[outputs.index(output)]
        session = runtime.session(
            backward.sessions, "backward", lambda: backward.graph.model, self.device, entry
        )
        results = dict(zip(backward.graph.grads_for, session.run(feeds)))
        return [results.get(name) for name in names]

    def _recompute(
        self, values: dict[str, torch.Tensor], missing: tuple[str, ...]
    ) -> dict[str, torch.Tensor]:
        """The prediction missed: rebuild the intermediates this mask needs from saved inputs."""
        entry, planned = self.entry, self.stash
        session = self.runtime.session(
            entry.sessions,
            ("recompute", planned, missing),
            lambda: stash_graphs.recompute_graph(entry, planned, missing),
            self.device,
            entry,
        )
        self.runtime.count_recompute()
        return dict(zip(missing, session.run({n: values[n] for n in session.input_names})))
