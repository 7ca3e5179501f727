"""The one autograd node of a lazy call: where PyTorch hands over the gradients and their mask."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Step(Protocol):
    """One call's forward and backward, as the runtime runs them (see `step.Step`)."""

    differentiable: tuple[bool, ...]

    def forward(
        self, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Outputs, and the tensors to save for backward."""

    def backward(
        self, saved: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """Gradient of each input (None where it is unreachable from the outputs given grads)."""


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
        ctx.mark_non_differentiable(
            *[out for out, diff in zip(outputs, step.differentiable) if not diff]
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "lazygrad: double backward (create_graph=True) through a lazy module is not "
                "supported; the backward runs in ONNX Runtime and records no autograd graph"
            )
        saved = ctx.saved_tensors
        return (None, *ctx.step.backward(saved, grads))
