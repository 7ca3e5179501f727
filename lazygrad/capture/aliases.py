"""How a forward's outputs share memory: the roots that carry gradients, and views of them.

A module may return a tensor and a view of it (`hidden, hidden[:, 0]`), two views of one
intermediate, a view of an input, or a parameter itself. AOTAutograd gives a cotangent only to
outputs that alias nothing (its other outputs are regenerated from their bases), so cotangents
cannot be handed to the backward graph output by output. Lazygrad therefore passes *roots*
through autograd: the distinct tensors the outputs are, or are views of, other than the module's
inputs. Every output is made outside the autograd node, in torch, as its root or a view of it
(or of its input), so autograd sums a view's gradient into its root's exactly as eager does, an
output can be changed in place as in eager, and the backward graph gets one cotangent per root.

An output a custom autograd Function returned is a root even where it is a view: its node's
backward is the Function's own.

The same function reads eager's outputs (the probe of a first step) and the traced ones (the
trace returns the roots, `trace.Functional`), so both number roots alike.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch

from lazygrad.capture import private


@dataclasses.dataclass(frozen=True)
class Aliasing:
    """Per flat tensor output: ("root", k) or ("primal", i), and whether it is a view of that
    source (False: it is the source itself)."""

    sources: tuple[tuple[str, int], ...]
    views: tuple[bool, ...]

    @property
    def root_count(self) -> int:
        return 1 + max((i for kind, i in self.sources if kind == "root"), default=-1)

    def root_mask(self, mask: Sequence[bool]) -> tuple[bool, ...]:
        """Roots that get a gradient when the outputs in `mask` do."""
        bits = [False] * self.root_count
        for (kind, index), bit in zip(self.sources, mask):
            if kind == "root" and bit:
                bits[index] = True
        return tuple(bits)

    def output_mask(self, root_mask: Sequence[bool]) -> tuple[bool, ...]:
        """The grad mask as lazygrad keys graphs on it: an output counts as receiving a gradient
        when its root does (outputs of one root are one unit: their gradients reach the
        backward summed); a view of an input never does (its gradient never reaches the
        graphs: autograd takes it to the input directly)."""
        return tuple(kind == "root" and root_mask[index] for kind, index in self.sources)

    def normalized(self, mask: Sequence[bool]) -> tuple[bool, ...]:
        return self.output_mask(self.root_mask(mask))

    def own_roots(self) -> tuple[bool, ...]:
        """Per output, whether it is a root itself (not a view, nor an input)."""
        return tuple(kind == "root" and not view
                     for (kind, _), view in zip(self.sources, self.views))

    def remake(self, outputs: Sequence[torch.Tensor], roots: Sequence[torch.Tensor]
               ) -> list[torch.Tensor]:
        """`outputs` (eager's) made again from `roots` (eager's behind a probe): each view
        replayed on its new root, as eager made it."""
        return [
            output if kind == "primal" else
            private.replay_view(output, roots[index]) if view else roots[index]
            for output, (kind, index), view in zip(outputs, self.sources, self.views)
        ]


def aliasing(outputs: Sequence[torch.Tensor], primals: Sequence[torch.Tensor],
             inference: bool = False) -> tuple[Aliasing, list[torch.Tensor]]:
    """The aliasing of `outputs` (eager's or traced) and their roots, in order of first use.
    `inference` (a call without autograd): an output that is the only one viewing its root is
    a root itself. That it views a tensor nothing else holds is unobservable there, and eager
    and a trace may disagree on it (`nn.MultiheadAttention`'s fast path in eval under no_grad
    makes the next Linear's output a view, its traced path does not: such a model ran in
    parts)."""
    roots: list[torch.Tensor] = []
    sources = []
    views = []
    for output in outputs:
        base = output if output._base is None or _made_by_a_function(output) else output._base
        primal = next((i for i, p in enumerate(primals) if p is base), None)
        if primal is not None:
            sources.append(("primal", primal))
        else:
            index = next((i for i, r in enumerate(roots) if r is base), None)
            if index is None:
                index = len(roots)
                roots.append(base)
            sources.append(("root", index))
        views.append(output is not base)
    if inference:
        shared = collections.Counter(sources)
        for k, (output, source, view) in enumerate(zip(outputs, sources, views)):
            if view and source[0] == "root" and shared[source] == 1:
                roots[source[1]], views[k] = output, False
    return Aliasing(tuple(sources), tuple(views)), roots


def _made_by_a_function(output: torch.Tensor) -> bool:
    """Whether a custom autograd Function returned `output` (as AOTAutograd's
    `custom_function_view` tells). A Function may return a view of its input with a backward of
    its own (a gradient reversal layer; the identity that `register_full_backward_hook` puts
    around a submodule's output): replaying the view on its base would skip that backward, so
    such an output is a root of its own."""
    grad_fn = output.grad_fn
    return isinstance(grad_fn, torch.autograd.function.BackwardCFunction) or \
        type(grad_fn).__name__ == "CppFunction"
