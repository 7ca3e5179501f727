"""One call of a lazy module through ONNX Runtime that records autograd: forward, then backward.

The runtime decides which graphs serve the step (signature, plan, the pair for a new mask) and
hands the step what it needs; the step runs them, in the order `LazyFunction` calls it.

What the forward keeps: the primals (module state and inputs; a state tensor the forward updates
in place is kept as it was read), the forward results the planned backward reads, and the
random draws only if that backward reads them: a dropout's backward reads its mask, a boolean
the forward made, not the float32 draw it came from, which eager never keeps (CUDA's dropout
saves the mask alone; a BERT's attention dropout draws, kept, were four times its masks).
Under "predict", a backward whose mask differs from the plan reruns the forward of its own
pair from these, with the same draws: drawn again from the generator state the step drew them
from; "all" feeds zeros for outputs outside the mask, as ORTModule does; under "recompute" the
backward graph recomputes itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lazygrad import generators
from lazygrad.capture import private
from lazygrad.graph_pair import ChecksFailed, GraphPair

# (mask, primals, cotangents) -> the pair of that mask, found or built; None if it cannot be
PairFor = Callable[[tuple[bool, ...], list[torch.Tensor], tuple], GraphPair | None]
# (primals, cotangents, generator state the draws came from, create_graph) -> the gradients,
# by eager PyTorch
EagerBackward = Callable[[list[torch.Tensor], tuple, torch.Tensor | None, bool],
                         list[torch.Tensor | None]]


class Step:
    def __init__(
        self,
        pair: GraphPair,
        differentiable: tuple[bool, ...],
        policy: str,
        env: dict[str, int],
        device: torch.device,
        pair_for: PairFor,
        on_recompute: Callable[[], None],
        on_mask: Callable[[tuple[bool, ...]], None],
        eager_backward: EagerBackward,
    ) -> None:
        self.pair = pair
        self.policy = policy
        self.env = env
        self.device = device
        self.differentiable = differentiable
        self._pair_for = pair_for
        self._on_recompute = on_recompute
        self._on_mask = on_mask
        self._eager_backward = eager_backward
        self._generator_state: torch.Tensor | None = None  # before this step's draws
        self._layout: tuple[int, int, list[int]] = (0, 0, [])  # primals, draws, results kept
        self._draw_count = 0  # the draws made (kept or not)
        self._root_types: list[tuple[torch.Size, torch.dtype]] = []

    @property
    def frees_as_it_goes(self) -> bool:
        """Whether the planned backward runs in segments, freeing the stash between them."""
        return bool(self.pair.graphs.backward_segments)

    def forward(
        self, primals: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pair = self.pair
        draws: list[torch.Tensor] = []
        if pair.graphs.draws:
            self._generator_state = generators.state(self.device)
            draws = pair.draw(self.env, self.device)
        try:
            results = pair.forward(primals, draws, self.device)
        except ChecksFailed:  # the call runs again in eager PyTorch, drawing what eager draws
            if draws:
                generators.set_state(self.device, self._generator_state)
            raise
        roots = pair.roots(results, self.env)
        kept_primals = list(primals) if pair.graphs.mutations else primals
        for _, primal in pair.graphs.mutations:
            # A rerun of the forward must read what this one read, not the updated value.
            kept_primals[primal] = primals[primal].detach().clone()  # type: ignore[index]
        pair.write_back(primals, results)
        read = pair.outputs_read_by_backward
        self._draw_count = len(draws)
        if not (self.policy == "recompute" or pair.backward_reads_draws):
            draws = []
        self._layout = (len(primals), len(draws), read)
        if self.policy == "all":  # zeros of these are fed for roots without a gradient
            self._root_types = [(r.shape, r.dtype) for r in roots]
        return roots, [*kept_primals, *draws, *map(results.__getitem__, read)]

    def backward(
        self, saved: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """`grads`: one per root (`aliases.py`). `saved` (what `forward` kept) is handed over
        and emptied: the pair's backward frees each stashed tensor once no later segment reads
        it."""
        count, draw_count, _ = self._layout
        primals = saved[:count]
        draws = saved[count : count + draw_count]
        kept = saved[count + draw_count :]
        saved.clear()
        root_mask = tuple(g is not None for g in grads)
        if not any(root_mask):
            return [None] * count
        if torch.is_grad_enabled() or private.any_batched(grads):
            # create_graph=True: ORT's backward records no graph of its own, so eager's does; so
            # too for a batch of cotangents under vmap (`is_grads_batched`, a vectorised
            # jacobian), which ORT cannot take.
            return self._eager_backward(primals, grads, self._generator_state,
                                        torch.is_grad_enabled())
        if self.policy == "all":
            return self._backward_all(primals, draws, kept, grads, root_mask)
        mask = self.pair.aliasing.output_mask(root_mask)
        self._on_mask(mask)
        pair = self._pair_for(mask, primals, grads)
        if pair is None:
            return self._eager_backward(primals, grads, self._generator_state, False)
        if self.policy == "recompute":
            return pair.backward(primals, draws, [], grads, self.device)
        if pair is self.pair:
            results = self._results(kept)
        else:
            self._on_recompute()
            draws = self._all_draws(draws)
            results = pair.forward(primals, draws, self.device)
        del kept
        if pair.backward_reads_draws:
            draws = self._all_draws(draws)
        return pair.backward(primals, draws, results, grads, self.device)

    def _backward_all(
        self,
        primals: list[torch.Tensor],
        draws: list[torch.Tensor],
        kept: list[torch.Tensor],
        grads: tuple[torch.Tensor | None, ...],
        root_mask: tuple[bool, ...],
    ) -> list[torch.Tensor | None]:
        """ORTModule's way: the one all-outputs graph, zeros for roots without a gradient."""
        pair = self._pair_for(self.pair.mask, primals, grads)
        if pair is None:
            return self._eager_backward(primals, grads, self._generator_state, False)
        results = self._results(kept)
        kept.clear()
        if pair.backward_reads_draws:
            draws = self._all_draws(draws)
        cotangents = [
            grad if grad is not None or not wanted
            else torch.zeros(shape, dtype=dtype, device=self.device)
            for grad, wanted, (shape, dtype) in zip(grads, pair.root_mask, self._root_types)
        ]
        gradients = pair.backward(primals, draws, results, cotangents, self.device)
        for primal in pair.unreached(root_mask):
            gradients[primal] = None
        return gradients

    def _all_draws(self, kept: list[torch.Tensor]) -> list[torch.Tensor]:
        """This step's draws: those kept, or all drawn again from the generator state the step
        drew them from (the generator itself is left where it is)."""
        if len(kept) == self._draw_count:
            return kept
        assert self._generator_state is not None
        return self.pair.draw(self.env, self.device,
                              generators.copy_of(self.device, self._generator_state))

    def _results(self, kept: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The forward results the backward reads, at their indices (None elsewhere)."""
        read = self._layout[2]
        results: list[torch.Tensor | None] = [None] * (max(read, default=-1) + 1)
        for index, tensor in zip(read, kept):
            results[index] = tensor
        return results

