"""Traced tensors that outlive the trace: user code kept one, so the graphs cannot stand in.

A forward hook that stores a submodule's output for later (a feature extractor, an activation
logger, a distillation loss), or code that appends to a global, runs once during the trace with
the trace's tensors and never again on ORT steps: the store would hold a tensor that cannot be
used ("Attempting to use FunctionalTensor on its own") where eager keeps each step's. Hooks whose
tensors stay inside the call (Hugging Face's output recorders fill a collector that the same
forward returns) are traced as any other code. So the trace itself is the test: any traced
tensor still referenced once it returns was kept by user code, and the call cannot be captured
whole; the module then runs in parts, whose calls fire the hooks with real tensors.

By then the trace's tensors sit in the user's objects. So a signature's first call, run by eager
PyTorch, is watched first (`forward_hooks.watching_eager_call`): a tensor that a hook (the
user's or a library's) was given or made, still referenced by a Python object once the call
returned (neither returned, nor the module's own state, nor one of its attributes, nor a
module's global), was kept by the hook, and the module goes to its parts without a trace
(`refuse_kept_by_hooks`).
So does a first call that put a new tensor in a list or dict among the globals the module's code
reads (`GlobalStores`: `ACTIVATIONS.append(h)` in a forward).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lazygrad.capture import private
from lazygrad.capture.errors import CaptureError
from lazygrad.code_globals import names_read


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
        _refuse(kept, "traced ", sorted({
            _holder(tensor, [r for r in gc.get_referrers(tensor) if r is not kept])
            for tensor in kept}))


def refuse_kept_by_hooks(touched: Iterable[weakref.ref], module: torch.nn.Module,
                         own: Iterable[torch.Tensor]) -> None:
    """After an eager call of `module`: raise CaptureError, naming what holds them, if tensors
    that hooks saw or made (`touched`) are still held by Python objects other
    than the module's, Python modules' globals, and frames; `own`: the call's inputs, the
    module's state and what the call returned, which the caller holds."""
    skipped = {id(tensor) for tensor in own}
    alive = {id(tensor): tensor for tensor in (reference() for reference in touched)
             if tensor is not None and id(tensor) not in skipped}
    if not alive:
        return
    tensors = list(alive.values())
    ignored = {id(tensors), id(alive)} | _owned_namespaces(module)
    holders = [holder for holder in gc.get_referrers(*tensors)
               if id(holder) not in ignored and not isinstance(holder, types.FrameType)]
    kept = [tensor for tensor in tensors
            if any(_holds(holder, tensor) for holder in holders)]
    if kept:
        _refuse(kept, "", sorted({_holder(tensor, [h for h in holders if _holds(h, tensor)])
                                  for tensor in kept}))


class GlobalStores:
    """The lists and dicts among the globals (and closed-over values) that a module's code
    reads, with the tensors each held when this was made: made before an eager call, asked
    after it (`refuse_new`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        stores = {id(value): (label, value) for namespace, name, label in names_read(module)
                  if type(value := namespace.get(name)) in (list, dict)}
        self._stores = list(stores.values())
        self._held = [{id(t) for t in _tensors_in(store)} for _, store in self._stores]

    def refuse_new(self, own: Iterable[torch.Tensor]) -> None:
        """Raise CaptureError, naming the store, if one holds a tensor it did not hold before,
        other than `own` (the call's inputs, the module's state, what it returned)."""
        skipped = {id(tensor) for tensor in own}
        found = [(label, store, tensor) for (label, store), held in zip(self._stores, self._held)
                 for tensor in _tensors_in(store)
                 if id(tensor) not in held and id(tensor) not in skipped]
        if found:
            _refuse([tensor for _, _, tensor in found], "", sorted(
                {f"a {type(store).__name__}, {label}" for label, store, _ in found}))


def _tensors_in(store: list | dict) -> list[torch.Tensor]:
    items = store.values() if isinstance(store, dict) else store
    return [item for item in list(items) if isinstance(item, torch.Tensor)]


def _refuse(kept: list[torch.Tensor], kind: str, holders: list[str]) -> None:
    raise CaptureError(
        f"the forward keeps {len(kept)} {kind}tensor(s) after the call ({'; '.join(holders)}): "
        "a hook or other user code stores them, so ORT steps would leave it holding tensors "
        "that cannot be used where eager stores each step's"
    )


def _owned_namespaces(module: torch.nn.Module) -> set[int]:
    """The ids of the dicts where `module`'s submodules keep their state and attributes, and
    of every imported Python module's globals."""
    owned = {id(vars(python_module)) for python_module in list(sys.modules.values())
             if python_module is not None}
    for submodule in module.modules():
        owned |= {id(vars(submodule)), id(submodule._parameters), id(submodule._buffers)}
    return owned


def _holds(holder: object, tensor: torch.Tensor) -> bool:
    return any(referent is tensor for referent in gc.get_referents(holder))


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


def _holder(tensor: object, referrers: list[object]) -> str:
    """A short description of what of `referrers` references `tensor` (a dict key, a list)."""
    for referrer in referrers:
        if isinstance(referrer, dict):
            keys = [key for key, value in referrer.items() if value is tensor]
            if keys:
                return f"a dict, under {keys[0]!r}"
    return f"a {type(referrers[0]).__name__}" if referrers else "an object"
