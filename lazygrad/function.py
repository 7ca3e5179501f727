"""The autograd nodes of a lazy call: where PyTorch hands over the gradients and their mask.

`LazyFunction` is one call through ONNX Runtime. `MaskProbe` sits on the outputs of a call that
ran in eager PyTorch (the first step of a signature): it passes the gradients through unchanged
and tells the runtime which outputs received one, the grad mask to build graphs for
(`behind_probe`).
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

import torch

from lazygrad.capture.private import (
    release_saved_tensors,
    set_versions,
    skip_hooks_without_gradient,
)


class Step(Protocol):
    """One call's forward and backward, as the runtime runs them (see `step.Step`)."""

    differentiable: tuple[bool, ...]
    # Whether its backward frees the stash as it goes (runs in segments): only then do the
    # autograd node's own references to it matter before the backward ends.
    frees_as_it_goes: bool

    def forward(
        self, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Outputs, and the tensors to save for backward: the inputs first, in their order."""

    def backward(
        self, saved: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """Gradient of each input (None where it is unreachable from the outputs given grads).
        `saved` is handed over (emptied), so that each tensor can be freed once used."""


class Probe(Protocol):
    def on_backward(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The gradients that reached the probed outputs (None: that output got none)."""


class LazyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, step: Step, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Without materialised grads, an output that got no gradient arrives as None: that None
        # is the grad mask, and no zero tensor is ever made for it.
        ctx.set_materialize_grads(False)
        outputs, saved = step.forward(inputs)
        # Saved through autograd so an in-place change between forward and backward raises
        # PyTorch's own version-counter error, and a second backward raises its own error.
        ctx.save_for_backward(*saved)
        ctx.step = step
        if not all(step.differentiable):
            ctx.mark_non_differentiable(
                *[out for out, diff in zip(outputs, step.differentiable) if not diff]
            )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        inputs = saved[: len(ctx.needs_input_grad) - 1]
        if ctx.step.frees_as_it_goes:  # the step holds the only references from here
            release_saved_tensors(ctx)  # (a hook per tensor: 28 a call on the MoE layer)
        gradients = ctx.step.backward(saved, grads)
        for tensor, gradient, needed in zip(inputs, gradients, ctx.needs_input_grad[1:]):
            if gradient is None and needed:
                skip_hooks_without_gradient(tensor)
        return (None, *gradients)


class MaskProbe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, probe: Probe, same: tuple[bool, ...], *outputs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.probe = probe
        ctx.mark_dirty(*(o for o, kept in zip(outputs, same) if kept))
        return tuple(o if kept else o.view_as(o) for o, kept in zip(outputs, same))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.probe.on_backward(grads)
        return (None, None, *grads)


def behind_probe(probe: Probe, outputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`outputs` (eager's, each requiring grad) behind one MaskProbe.

    What a Function returns as it was given is a view, which may not be changed in place: a
    model that divides a submodule's output in place (`y = proj(x); y /= scale`) failed at the
    first step, and ran from the second, through ORT. So an output comes back as the very
    tensor eager made, marked as changed in place by the probe, at its version of before (the
    eager graph's saved tensors stay valid). Not where it is a leaf or a view, or shares memory
    with another output: marking would change another tensor's history, and autograd allows a
    marked view only as a Function's one output; those come back as views, as the outputs of
    later calls that are views do (`LazyFunction`). One node for all outputs: the backward of
    any of them runs it, and with it eager's graph of the others, whose saved tensors it then
    frees (a vocabulary head's log-softmax, kept alive by the held outputs otherwise)."""
    storages = collections.Counter(o.untyped_storage().data_ptr() for o in outputs)
    same = tuple(not o.is_leaf and o._base is None and storages[o.untyped_storage().data_ptr()] == 1
                 for o in outputs)
    versions = [o._version for o, kept in zip(outputs, same) if kept]
    probed = MaskProbe.apply(probe, same, *outputs)
    set_versions([o for o, kept in zip(probed, same) if kept], versions)
    return probed

