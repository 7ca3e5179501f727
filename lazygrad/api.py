"""The public surface: `lazy` (decorator or wrapper), and the statistics of a lazy model."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from lazygrad import attach, runtime
from lazygrad.options import SEGMENTS, Options
from lazygrad.runtime import Runtime
from lazygrad.stats import Stats

M = TypeVar("M", bound=torch.nn.Module)


@overload
def lazy(target: type[M], /) -> type[M]: ...
@overload
def lazy(target: M, /) -> M: ...
@overload
def lazy(
    *, policy: str = "predict", cache_size: int = 64, strict: bool = False,
    wait_for_builds: bool | None = None, segments: int = SEGMENTS, arena: bool = False,
    recompute_layers: bool = False,
) -> Callable[[Any], Any]: ...


def lazy(
    target: Any = None,
    /,
    *,
    policy: str = "predict",
    cache_size: int = 64,
    strict: bool = False,
    wait_for_builds: bool | None = None,
    segments: int = SEGMENTS,
    arena: bool = False,
    recompute_layers: bool = False,
) -> Any:
    """Route a module's calls through lazygrad's runtime.

    `@lazygrad.lazy` on an `nn.Module` class makes every instance lazy; `lazygrad.lazy(model)`
    makes one existing instance lazy (and returns it). With arguments, `@lazygrad.lazy(...)`.

    policy: what the forward keeps for backward: "predict" (what the backward of the mask
    forecast from the masks seen reads, `forecast.py`), "all" (what every output's backward
    reads; zeros for the others, as ORTModule does) or "recompute" (inputs and random draws
    only; the backward recomputes the forward).
    cache_size: how many pairs of graphs (one per signature and mask) the model keeps (LRU).
    strict: raise `LazygradError` instead of falling back to eager PyTorch (builds are then
    waited for, so the step that meets a failure raises).
    wait_for_builds: block the step that needs new graphs until they are built. By default
    (False, or the environment's LAZYGRAD_WAIT_FOR_BUILDS=1) such steps run in eager PyTorch
    while the graphs build on a background thread, and the first call after that runs in ORT.
    segments: run each backward as up to this many graphs in order (cut where the stash is
    released; one per 16 MiB of stash at least), freeing the stashed tensors each has read
    last as it returns; 1: one graph.
    arena: ORT takes CPU memory from its own arena, which keeps it between steps: measured,
    steps about 10% faster (13-18% on a deeper model), at the same whole-process peak on a
    single input shape, but up to 1.9x the peak when shapes and grad masks vary
    (session.py has the figures). By default ORT allocates as torch does.
    recompute_layers: the forward keeps only what enters each of the model's repeated layers
    (the children of a ModuleList or Sequential that repeat), and the backward recomputes a
    layer's activations just before its backward, as activation checkpointing does: one more
    forward of each layer for a smaller stash (capture/layers.py). Same gradients.
    """
    options = Options(policy=policy, cache_size=cache_size, strict=strict, segments=segments,
                      arena=arena, recompute_layers=recompute_layers)
    if wait_for_builds is not None:
        options = dataclasses.replace(options, wait_for_builds=wait_for_builds)

    def apply(target: Any) -> Any:
        if isinstance(target, type) and issubclass(target, torch.nn.Module):
            return _lazy_class(target, options)
        if isinstance(target, torch.nn.Module):
            return _lazy_instance(target, options)
        raise TypeError(
            f"lazygrad.lazy expects an nn.Module subclass or instance, got {type(target).__name__}"
        )

    return apply if target is None else apply(target)


def _lazy_class(cls: type[M], options: Options) -> type[M]:
    if attach.ORIGINAL_FORWARD in cls.__dict__:
        raise TypeError(f"lazygrad: {cls.__name__} is lazy already")
    original = cls.__dict__.get("forward")
    if original is None:
        raise TypeError(f"lazygrad: {cls.__name__} must define forward to be made lazy")

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return attach.call_lazily(runtime_of(self), args, kwargs)

    setattr(cls, attach.ORIGINAL_FORWARD, original)
    setattr(cls, attach.OPTIONS, options)
    cls.forward = forward  # type: ignore[method-assign]
    return cls


def _lazy_instance(module: M, options: Options) -> M:
    if attach.installed(module) is not None or attach.OPTIONS in type(module).__dict__:
        raise TypeError(f"lazygrad: this {type(module).__name__} is lazy already")
    attach.install(module, Runtime(module, options))
    return module


def runtime_of(module: torch.nn.Module) -> Runtime:
    found = runtime.runtime_of(module)
    if found is None:
        raise TypeError(
            f"lazygrad: {type(module).__name__} is not lazy; use @lazygrad.lazy or lazygrad.lazy(m)"
        )
    return found


def stats(model: torch.nn.Module) -> Stats:
    """A snapshot of the model's cache statistics (hits, misses, builds, entries ...)."""
    return runtime_of(model).snapshot()


def reset_stats(model: torch.nn.Module) -> None:
    """Zero the counters; cached graphs stay."""
    runtime_of(model).reset_stats()


def wait_for_builds(model: torch.nn.Module, timeout: float | None = None) -> None:
    """Block until the graphs being built for the model (in the background) are ready, or
    have failed (then recorded as a fallback), or `timeout` seconds have passed."""
    runtime_of(model).wait_for_builds(timeout)


def clear_cache(model: torch.nn.Module) -> None:
    """Drop every cached graph and session of the model (the next call exports again)."""
    runtime_of(model).clear()
