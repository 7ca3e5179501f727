"""Draws from Python's or NumPy's random generators while tracing, and reseeding torch's:
refused.

A trace runs the forward's Python once, so a draw made there (teacher forcing decided by
`random.random() < ratio` in a seq2seq model's forward, a layer skipped on `np.random.uniform()`)
becomes a constant of the graph: every ORT step would take the branch the trace took, where
eager draws again at each call. torch's own random ops are drawn per step (`draws.py`); these
generators cannot be. So a trace that drew makes the capture fail, and the module runs in parts
or eagerly:

- the global generators: while a trace runs, the functions of the `random` and `numpy.random`
  modules, and those the user's code imported by name (`from random import random`, which
  served the trace's draw at every step before), record a call made from the tracing thread
  (other threads, a data loader's, draw as usual and are not counted); the trace's own draw
  is made from a copy of the generator, so the user's seeded stream of numbers is eager's;
- generators of their own (a `random.Random`, a NumPy `Generator` or `RandomState`) that the
  traced modules hold or the user's code reads as a global: their state before and after the
  trace is compared. The modules traced are a copy of the model's (`Runtime`), so the
  training thread's draws from those do not count; a global one drawn from by another thread
  while the trace runs is refused too (eager, not wrong);
- torch's own generators reseeded or set (`torch.manual_seed`, `torch.seed`,
  `torch.set_rng_state`, their `torch.random` and `torch.cuda` twins; a fixed augmentation,
  Reformer's layers, `torch.random.fork_rng`, a reversible layer whose backward replays its
  forward's Dropout from the state it saved): no ORT step reseeds or sets a state, so the draws
  after it were other than eager's, and the generator was left elsewhere (a Dropout after
  `torch.manual_seed(123)` in the forward: 0.87 off at every ORT step; the reversible layer's
  weight gradient 1.2-1.5 off, its replayed mask drawn anew: both silently). On the tracing
  thread the call is recorded and not made (AOTAutograd's own setting back of the generators
  after a trace is off, `private.generators_left_alone`).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import random
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

from lazygrad.capture.errors import CaptureError
from lazygrad.code_globals import names_read

_STATE = {"getstate", "setstate", "seed", "get_state", "set_state"}
_TORCH_SETTERS = ("manual_seed", "seed", "manual_seed_all", "seed_all", "set_rng_state",
                  "set_rng_state_all")


@contextlib.contextmanager
def refusing_draws(module: torch.nn.Module) -> Iterator[None]:
    """Inside, a draw from the tracing thread is recorded; on a clean exit, one raises."""
    drawn: list[str] = []
    thread = threading.get_ident()
    read = list(names_read(module))  # the user's code's names, walked once
    owners = {id(_owner(m)) for m in _modules()}
    swapped: list[tuple[dict, str, Callable[..., Any]]] = []
    watched = [(namespace, name, label, _from_a_copy(namespace[name]))
               for namespace, name, label in _global_draws(read, owners)]
    watched += [(namespace, name, label, _not_made)
                for namespace, name, label in _torch_setters(read)]
    for namespace, name, label, instead in watched:
        swapped.append((namespace, name, namespace[name]))
        namespace[name] = _recording(namespace[name], label, thread, drawn, instead)
    generators = _own_generators(module, read, owners)
    states = [_state_of(generator) for _, generator in generators]
    try:
        yield
    finally:
        for namespace, name, function in swapped:
            namespace[name] = function
    drawn.extend(label for (label, generator), state in zip(generators, states)
                 if _state_of(generator) != state)
    if drawn:
        raise CaptureError(
            f"the forward draws from a random generator, or reseeds one "
            f"({', '.join(sorted(set(drawn)))}): a graph would replay the trace's draw at every "
            "step, or reseed nothing, where eager draws (or reseeds) at each call"
        )


def _global_draws(read: list[tuple[Mapping, str, str]],
                  owners: set[int]) -> Iterator[tuple[dict, str, str]]:
    """(namespace, name, label) of the functions that draw from a global generator (`owners`:
    their ids): those of the `random` and `numpy.random` modules, and those the user's code
    holds as globals (`read`), each once."""
    found: dict[tuple[int, str], tuple[dict, str, str]] = {}
    named = [(vars(m), name, f"{m.__name__}.{name}") for m in _modules() for name in vars(m)]
    for namespace, name, label in named + read:
        if type(namespace) is dict and name not in _STATE \
                and id(getattr(namespace.get(name), "__self__", None)) in owners:
            found.setdefault((id(namespace), name), (namespace, name, label))
    return iter(found.values())


def _torch_setters(read: list[tuple[Mapping, str, str]]) -> Iterator[tuple[dict, str, str]]:
    """(namespace, name, label) of torch's functions that reseed or set its generators, in its
    modules (`torch.manual_seed` is `torch.random.manual_seed`: both names) and among the user
    code's globals (`read`), each once."""
    modules = (torch, torch.random, torch.cuda)
    named = [(vars(m), name, f"{m.__name__}.{name}") for m in modules for name in _TORCH_SETTERS
             if callable(vars(m).get(name))]
    functions = {id(namespace[name]) for namespace, name, _ in named}
    found: dict[tuple[int, str], tuple[dict, str, str]] = {}
    for namespace, name, label in named + read:
        if type(namespace) is dict and id(namespace.get(name)) in functions:
            found.setdefault((id(namespace), name), (namespace, name, label))
    return iter(found.values())


def _own_generators(module: torch.nn.Module, read: list[tuple[Mapping, str, str]],
                    owners: set[int]) -> list[tuple[str, object]]:
    """(label, generator) of the generators of their own that the modules hold (as attributes,
    or in the plain objects they hold) or the user's code reads as globals (`read`); the global
    ones (`owners`) are watched by function instead."""
    kinds = tuple(_generator_types())
    found: dict[int, tuple[str, object]] = {}
    for path, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            for attribute, held in [(name, value), *_held_by(name, value)]:
                if isinstance(held, kinds):
                    found.setdefault(id(held), (f"{path or 'the module'}.{attribute}", held))
    for namespace, name, label in read:
        value = namespace.get(name)
        if isinstance(value, kinds) and not isinstance(value, random.SystemRandom):
            found.setdefault(id(value), (label, value))
    return [entry for key, entry in found.items() if key not in owners]


def _held_by(name: str, value: object) -> list[tuple[str, object]]:
    attributes = getattr(value, "__dict__", None)
    if not attributes or isinstance(value, (torch.nn.Module, type)):
        return []
    return [(f"{name}.{key}", item) for key, item in attributes.items()]


def _state_of(generator: object) -> bytes:
    if isinstance(generator, random.Random):
        return pickle.dumps(generator.getstate())
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        return pickle.dumps(generator.bit_generator.state)
    return pickle.dumps(generator.get_state())  # numpy.random.RandomState


def _generator_types() -> Iterator[type]:
    yield random.Random
    for numpy_random in _modules()[1:]:
        yield from (numpy_random.Generator, numpy_random.RandomState)


def _modules() -> list[ModuleType]:
    """`random`, and `numpy.random` where it is loaded."""
    numpy_random = sys.modules.get("numpy.random")
    return [random] if numpy_random is None else [random, numpy_random]


def _owner(module: ModuleType) -> object:
    """The generator whose bound methods the module exposes as functions."""
    if module is random:
        return random._inst  # type: ignore[attr-defined]
    return module.mtrand._rand  # type: ignore[attr-defined]


def _recording(function: Callable[..., Any], name: str, thread: int, drawn: list[str],
               instead: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, where a call from `thread` is recorded in `drawn` and `instead` runs in its
    place (so the trace that is to be refused leaves the user's generators as they were);
    other threads' calls are the function's."""
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread:
            return function(*args, **kwargs)
        drawn.append(name)
        return instead(*args, **kwargs)

    recorded.__wrapped__ = function  # type: ignore[attr-defined]
    return recorded


def _from_a_copy(function: Callable[..., Any]) -> Callable[..., Any]:
    """The draw from a copy of the generator the bound method `function` draws from."""
    return lambda *args, **kwargs: getattr(copy.deepcopy(function.__self__),
                                           function.__name__)(*args, **kwargs)


def _not_made(*args: Any, **kwargs: Any) -> None:
    """A reseeding of torch's generators, not made."""
