"""The systems a user would pick instead of lazygrad, built from one model so weights agree.

Each peer also says how much it had to build: lazygrad through its statistics, torch.compile
through dynamo's counters (global, so read as differences around a phase with one compiled model).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

import lazygrad

EAGER, COMPILE, LAZY_ALL, LAZY = "eager", "torch.compile", "lazygrad all", "lazygrad"
PEERS = (EAGER, COMPILE, LAZY_ALL, LAZY)


def make(peer: str, base: nn.Module) -> nn.Module:
    """A copy of `base` that runs through `peer`.

    `lazygrad all` stashes for every output, as ORTModule's one pessimistic graph does; the
    default policy stashes for the grad mask last seen.
    """
    model = copy.deepcopy(base)
    if peer == EAGER:
        return model
    if peer == COMPILE:
        return torch.compile(model)
    if peer == LAZY_ALL:
        return lazygrad.lazy(model, policy="all")
    if peer == LAZY:
        return lazygrad.lazy(model)
    raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")


@dataclasses.dataclass(frozen=True)
class Builds:
    """What a peer built during a phase; None where the peer has no such notion."""

    exports: int | None = None
    builds: int | None = None  # lazygrad: backward graphs; torch.compile: graphs compiled
    hit_rate: float | None = None


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def builds(peer: str, model: nn.Module, compiled_before: int) -> Builds:
    """Builds since the last `lazygrad.reset_stats(model)` / since `compiled_before` was read."""
    if peer in (LAZY, LAZY_ALL):
        stats = lazygrad.stats(model)
        return Builds(stats.exports, stats.builds, stats.hit_rate)
    if peer == COMPILE:
        return Builds(builds=compiled_graphs() - compiled_before)
    return Builds()


def built(peer: str, model: nn.Module) -> list[lazygrad.EntryStats]:
    """The graph pairs a lazygrad peer holds, with their build seconds per stage; [] for others."""
    return lazygrad.stats(model).entries if peer in (LAZY, LAZY_ALL) else []


def reset(peer: str, model: nn.Module) -> None:
    """Zero lazygrad's counters so a phase reports only its own builds and hits."""
    if peer in (LAZY, LAZY_ALL):
        lazygrad.reset_stats(model)
