"""Traced tensors that outlive the trace: user code kept one, so the graphs cannot stand in.

A forward hook that stores a submodule's output for later (a feature extractor, an activation
logger, a distillation loss), or code that appends to a global, runs once during the trace with
the trace's tensors and never again on ORT steps: the store would hold a tensor that cannot be
used ("Attempting to use FunctionalTensor on its own") where eager keeps each step's. Hooks whose
tensors stay inside the call (Hugging Face's output recorders fill a collector that the same
forward returns) are traced as any other code. So the trace itself is the test: any traced
tensor still referenced once it returns was kept by user code, and the call cannot be captured
whole; the module then runs in parts, whose calls fire the hooks with real tensors.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lazygrad.capture import private
from lazygrad.capture.errors import CaptureError


@contextlib.contextmanager
def watching() -> Iterator[dict[int, Callable[[], Any]]]:
    """Around a trace: records the traced tensors it makes, for `refuse_kept_tensors`."""
    with private.functional_tensors_made() as made:
        yield made


def refuse_kept_tensors(made: dict[int, Callable[[], Any]], mode: object) -> None:
    """Raise CaptureError, naming what holds them, if a traced tensor the trace run in `mode`
    (its fake tensor mode) made is still referenced. Garbage in reference cycles is collected
    first, only where some are found alive."""
    if not _kept(made, mode):
        return
    gc.collect()
    kept = _kept(made, mode)
    if kept:
        holders = sorted({_holder(tensor, kept) for tensor in kept})
        raise CaptureError(
            f"the forward keeps {len(kept)} traced tensor(s) after the call "
            f"({'; '.join(holders)}): a hook or other user code stores them, so ORT steps "
            "would leave it holding tensors that cannot be used where eager stores each step's"
        )


def _kept(made: dict[int, Callable[[], Any]], mode: object) -> list[torch.Tensor]:
    alive = (reference() for reference in made.values())
    return [tensor for tensor in alive
            if tensor is not None and _mode_of(tensor) is mode and not _effect_token(tensor)]


def _effect_token(tensor: torch.Tensor) -> bool:
    """Whether AOTAutograd itself keeps `tensor`, as the token that orders an op with side
    effects (linalg's error checks), in a dict keyed by the effect's type: no user code kept
    it. (It was named as the reason for running in parts, hiding the real one: `linalg_inv_ex`
    has no ONNX translation.)"""
    holders = [r for r in gc.get_referrers(tensor) if isinstance(r, dict)]
    keys = [key for holder in holders for key, value in holder.items() if value is tensor]
    return bool(keys) and all(isinstance(key, private.EffectType) for key in keys)


def _mode_of(tensor: torch.Tensor) -> object:
    inner = torch._from_functional_tensor(tensor.elem)
    return getattr(inner, "fake_mode", None)


def _holder(tensor: object, kept: list[object]) -> str:
    """A short description of what references `tensor` (a dict key, a list), `kept` aside."""
    referrers = [r for r in gc.get_referrers(tensor) if r is not kept]
    for referrer in referrers:
        if isinstance(referrer, dict):
            keys = [key for key, value in referrer.items() if value is tensor]
            if keys:
                return f"a dict, under {keys[0]!r}"
    return f"a {type(referrers[0]).__name__}" if referrers else "an object"
