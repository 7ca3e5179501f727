"""The runtime of one lazy module: decides which graphs serve a call, and runs them.

Deciding is kept here: the call's signature, whether its graphs exist, the mask the forward
plans for (the policy), building a pair for a new mask, fallback. Building is `capture`'s job,
checking `verify`'s, running `GraphPair`'s and `Step`'s.

The life of a signature: its first call runs in eager PyTorch (its grad mask is not known yet),
with a `MaskProbe` on the outputs; at that step's backward the mask is known and the one pair of
graphs for it is built. From the next call on, the forward runs in ORT with the graphs of the
mask forecast from the masks seen so far (`forecast.py`), and a backward with another mask is a
miss that builds (or finds) its pair.
An inference call (no grad) builds its forward graph right after its first, eager, call.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import itertools
import operator
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from lazygrad import attach, builder, clock, disk_cache, generators, regions, turns
from lazygrad.capture import (
    Aliasing,
    Captured,
    CaptureError,
    Functional,
    Graphs,
    aliasing,
    capture,
    checks,
    export,
    private,
    refuse_reads,
    unchanged,
    watching_first_call,
)
from lazygrad.eager import eager_mode, in_eager_mode
from lazygrad.eager_record import EagerRecord, Watch
from lazygrad.errors import FallbackWarning, GraphBreakWarning, LazygradError, explain_bad_input
from lazygrad.forecast import MaskForecast
from lazygrad.function import LazyFunction, behind_probe
from lazygrad.graph_cache import GraphCache
from lazygrad.graph_pair import ChecksFailed, GraphPair
from lazygrad.index_key import index_key, pair_key, sizes_key
from lazygrad.module_state import ModuleState, global_modes, globals_part, plain_attributes
from lazygrad.options import Options
from lazygrad.outputs import OutputTemplate, sized_numbers, tensors_of
from lazygrad.parts import parts_of
from lazygrad.session import GraphRunError
from lazygrad.signature import (
    FlatCall,
    LastSignature,
    Signature,
    exact_shapes,
    flatten_call,
    leaf_names,
    named_keywords,
    opaque_leaf,
    sizes_for,
)
from lazygrad.stats import EntryStats, Stats
from lazygrad.step import Step
from lazygrad.verify import VerificationError, verify, verify_like_eager

Mask = tuple[bool, ...]
_creation_lock = threading.Lock()
_calling = threading.local()  # inside a lazy module's call on this thread


def runtime_of(module: torch.nn.Module, options: Options | None = None) -> Runtime | None:
    """The module's runtime: the one it holds, or a new one if its class is lazy or `options`
    are given (installed on the instance then). None: the module is not lazy."""
    runtime = attach.installed(module)
    if runtime is not None:
        return runtime
    class_options = attach.class_options(module)
    if class_options is None and options is None:
        return None
    with _creation_lock:
        runtime = attach.installed(module)
        if runtime is None:
            runtime = Runtime(module, class_options or options)
            if class_options is None:
                attach.install(module, runtime)
            else:
                module.__dict__[attach.RUNTIME] = runtime
        return runtime


@dataclasses.dataclass
class SignatureEntry:
    """What is known about one input signature once its first call has run."""

    id: str  # short name in the statistics
    call: FlatCall  # the call's structure and constants (no tensors)
    template: OutputTemplate
    differentiable: Mask  # per flat tensor output: eager's requires_grad
    aliasing: Aliasing  # how eager's outputs share memory (`capture/aliases.py`)
    state_names: list[str]
    device: torch.device  # of every tensor of the call and the module (part of the signature)
    plan: Mask | None = None  # the last mask served; the forward's plan where none is forecast
    index_key: str | None = None  # its records in the disk index (None: it has none)
    # what its first call read from tensors' values (`checks.recording`; None: unknown)
    reads: checks.Reads | None = None
    # the lines of code whose lengths and integers read from data are the first call's in its
    # graphs (the others: each call's); None: every one (a build with them each call's failed)
    fixed_lines: frozenset[tuple[str, int]] | None = frozenset()
    forecast: MaskForecast = dataclasses.field(default_factory=MaskForecast)
    reads_changed: int = 0  # background builds dropped for `ReadChanged`


@dataclasses.dataclass
class PairEntry:
    pair: GraphPair
    stats: EntryStats


# Calls whose graph's checks failed (a value read otherwise than by the first call: a branch
# the other way, another number or length; `capture/checks.py`), each run again eagerly, before
# a signature runs in parts: at least this many, and at least a fifth of its calls (a rare
# overflow guard stays served by its graph).
CHECK_MISSES = 4

# Values of a number argument that get graphs of their own before its calls run eagerly (as
# torch.compile's recompile limit): a few settings are each served, a changing one is not.
NUMBER_VALUES = 8


class ReadChanged(Exception):
    """A background build whose trace read another value of a global, a class attribute or a
    closed-over variable than its call did: the graphs would be another signature's."""


# Background builds of one signature dropped for `ReadChanged` before it runs without them
# (a value that changes at every step, faster than a trace).
READS_CHANGED = 3


def _unchanged_since(signature: Signature, module: torch.nn.Module) -> None:
    """Raise ReadChanged unless the values the module's code reads make the modes the
    signature was made with."""
    if global_modes(module) != globals_part(signature.modes):
        raise ReadChanged(
            "a module-level value its code reads (a global, a class attribute, a variable a "
            "function closes over) changed between the call and its graph's trace, at every "
            "try: its graphs would be another call's")


class BuildFailed(Exception):
    """Graphs for a signature could not be built or checked: the signature falls back.

    `where`: the submodule whose code failed (`CaptureError.where`), if known; `sizes`: a trace
    for the call's exact sizes may succeed (`CaptureError.sizes`); `whole`: the module's parts
    would fail alike, so none is tried; `blamed`: every submodule of `where`'s class would fail
    alike (`CaptureError.blamed`)."""

    def __init__(self, reason: str, where: str | None = None, sizes: bool = False,
                 whole: bool = False, blamed: bool = True) -> None:
        super().__init__(reason)
        self.where = where
        self.sizes = sizes
        self.whole = whole
        self.blamed = blamed


class Runtime:
    """Owns one module's caches and statistics; called in place of the module's forward."""

    def __init__(self, module: torch.nn.Module, options: Options) -> None:
        self.module = module
        self.options = options
        self._init_caches()

    def _init_caches(self) -> None:
        self.forward_fn = attach.run_forward
        self._state = ModuleState(self.module)
        self._signatures = LastSignature()
        self._lock = threading.RLock()
        self.stats = Stats()
        self._entries: dict[Signature, SignatureEntry] = {}
        self._pairs = GraphCache(self.options.cache_size, self._count_eviction)
        # signatures (without their sizes: every size of one fails alike) that fall back, or
        # run in parts, and why
        self._fallbacks: dict[Signature, str] = {}
        self._broken: dict[Signature, str] = {}
        # per signature without its sizes: the sizes its graphs are specialised on
        # (`signature.sizes_for`); those whose trace failed with sizes as symbols get none, each
        # call's exact sizes are its own
        self._sizes: dict[Signature, tuple[tuple[int | None, ...], ...]] = {}
        self._sizes_keys: dict[Signature, str | None] = {}  # their records in the disk index
        self._exact_sizes: set[Signature] = set()
        # the last (signature, sizes, signature with the sizes): the same object while they
        # repeat, so cache lookups hit on identity (`LastSignature`)
        self._last_sized: tuple[Signature, tuple, Signature] | None = None
        self._parts: list[tuple[str, Runtime]] | None = None  # made at the first break
        self._doomed: tuple[str, bool, list[str]] | None = None  # see `doom`
        self._building: dict[tuple[Signature, Mask | None], concurrent.futures.Future] = {}
        self._generation = 0  # `clear` drops what builds started before it bring
        self._ids = itertools.count()
        self._changing_calls = 0  # first calls in a row that changed the module's attributes
        self._changing = False  # its calls keep changing its attributes: it runs in parts
        # (submodule path, name) of the tensor attributes each call writes (`_adopt_writes`)
        self._writes: tuple[tuple[str, str], ...] = ()
        # per signature with its numbers left out: the numbers' values met (`_numbers_churn`)
        self._numbers_seen: dict[Signature, set[tuple]] = {}
        # per signature without its sizes: calls whose graph's checks failed (`CHECK_MISSES`)
        self._missed_checks: dict[Signature, int] = {}
        directory = disk_cache.default_directory()
        self._disk = disk_cache.DiskCache(directory) if directory else None

    def __getstate__(self) -> dict[str, Any]:
        # Sessions and graphs are rebuilt on demand; a copy starts with empty caches and stats.
        return {"module": self.module, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_caches()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pairs.clear()
            self._fallbacks.clear()
            self._broken.clear()
            self._sizes.clear()
            self._sizes_keys.clear()
            self._exact_sizes.clear()
            self._last_sized = None
            self._doomed = None
            self._changing, self._changing_calls = False, 0
            self._numbers_seen.clear()
            self._missed_checks.clear()
            self._building.clear()
            self._generation += 1
        for _, part in self._parts or []:
            part.clear()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = Stats(reasons=self.stats.reasons)  # why is not a counter: it stays
            for entry in self._pairs.values():
                entry.stats.hits = 0
        for _, part in self._parts or []:
            part.reset_stats()

    def snapshot(self) -> Stats:
        """The statistics, with those of every part (and their parts) by qualified name."""
        with self._lock:
            entries = [dataclasses.replace(e.stats) for e in self._pairs.values()]
            own = dataclasses.replace(self.stats, entries=entries,
                                      reasons=list(self.stats.reasons))
        parts: dict[str, Stats] = {}
        for name, part in self._parts or []:
            snapshot = part.snapshot()
            parts[name] = dataclasses.replace(snapshot, parts={})
            parts.update({f"{name}.{inner}": stats for inner, stats in snapshot.parts.items()})
        own.parts = parts
        return own

    def _count_eviction(self, key: Hashable, value: Any) -> None:
        self.stats.evictions += 1

    # ---- the call ----------------------------------------------------------------------------

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if in_eager_mode():
            return self._eager(args, kwargs)
        if getattr(_calling, "active", False):
            return self._dispatch(args, kwargs)
        # The module the user called: a check waiting for its turn runs first (`turns.py`); its
        # forward and backward are timed (`Stats.ort_share`).
        turns.call_starting()
        _calling.active = True
        window = clock.Window()
        try:
            result = self._dispatch(args, kwargs)
        finally:
            _calling.active = False
        self._count_time(*window.close())
        differentiable = []
        if torch.is_grad_enabled():
            with contextlib.suppress(ValueError):  # a result lazygrad cannot walk: untimed
                differentiable = [t for t in tensors_of(result) if t.requires_grad]
        if differentiable:
            clock.time_backward(differentiable, self._count_time)
        return result

    def _count_time(self, wall: float, ort: float) -> None:
        with self._lock:
            self.stats.step_seconds += wall
            self.stats.ort_seconds += ort

    def _dispatch(self, args: tuple, kwargs: dict) -> Any:
        call = flatten_call(args, kwargs, self._keywords if kwargs else ())
        if any(t.is_nested or t.layout != torch.strided for t in call.tensors):
            return self._call_without_graphs(args, kwargs, call)
        if self._changing:
            return self._changing_call(args, kwargs)
        opaque = opaque_leaf(call)
        if opaque is not None:
            name = self._leaf_names(args, kwargs)[opaque]
            kind = type(call.leaves[opaque])
            # A Hugging Face model hands its layers the cache it fills while `use_cache` is on.
            cache = kind.__module__.startswith("transformers") and kind.__name__.endswith("Cache")
            self._say_once(
                f"{type(self.module).__name__}: its calls with {name} (a {kind.__name__}) run "
                "in eager PyTorch: a graph would hold what that object holds as constants, and "
                "would not make the changes the forward makes to it"
                + (" (in training, `use_cache=False` keeps the model from making one)"
                   if cache else ""), stacklevel=7)
            with self._lock:
                self.stats.eager_steps += 1
            return self._eager(args, kwargs)
        with self._lock:
            state, modes = self._state.read()
            uninitialized = self._state.uninitialized
            if not uninitialized:
                signature = self._signatures.of(call, state, modes)
        if uninitialized:  # `nn.LazyLinear` and kin: the first call gives them their shapes
            with self._lock:
                self.stats.eager_steps += 1
            return self._eager(args, kwargs)
        return self._call(signature, call, state, args, kwargs)

    def _call_without_graphs(self, args: tuple, kwargs: dict, call: FlatCall) -> Any:
        """A call with a tensor no graph takes. A nested tensor (a module's inference fast
        path hands its layers one) runs as it would without lazygrad. A sparse one (a graph
        network's adjacency matrix; ONNX has no sparse tensors): the module's own code runs in
        eager PyTorch and its parts through ORT, said once; it ran eagerly whole, unsaid."""
        position = next((i for i, leaf in enumerate(call.leaves) if isinstance(leaf, torch.Tensor)
                         and not leaf.is_nested and leaf.layout != torch.strided), None)
        if position is not None:
            name = self._leaf_names(args, kwargs)[position]
            reason = (f"{type(self.module).__name__}: its calls with {name} (a tensor of layout "
                      f"{call.leaves[position].layout}) run its own code in eager PyTorch: ONNX "
                      "has no sparse tensors")
            if self._say_in_parts_or_eagerly(reason, "", "", stacklevel=8):
                return self.forward_fn(self.module, *args, **kwargs)
        with self._lock:
            self.stats.eager_steps += 1
        return self._eager(args, kwargs)

    def _sized(self, signature: Signature, tensors: list[torch.Tensor],
               state: dict) -> Signature:
        """The signature with the sizes its graphs are specialised on for this call: the first
        call's, and symbols for those later calls change (`signature.sizes_for`). Under the
        lock.

        Which sizes were symbols is kept in the disk index: a next process of a training
        whose batch size or sequence length varied starts with them as symbols, so the graphs
        the last one built serve its first call at any size (a batch-size search, a run at
        another batch), as torch.compile's profile of dynamic sizes does."""
        shapes = exact_shapes(tensors)
        if signature in self._exact_sizes:
            return signature.with_shapes(shapes)
        known = self._sizes.get(signature)
        if known is None and signature not in self._sizes_keys:
            known = self._sizes_from_disk(signature, state, shapes)
            if known is not None:
                self._sizes[signature] = known
        sizes = sizes_for(known, shapes)
        if sizes is not known:
            self._sizes[signature] = sizes
            key = self._sizes_keys.get(signature)
            if key is not None and known is not None:  # a size became a symbol
                self._disk.write_record(key, {"sizes": sizes})
        last = self._last_sized
        if last is not None and last[0] is signature and last[1] is sizes:
            return last[2]
        sized = signature.with_shapes(sizes)
        self._last_sized = (signature, sizes, sized)
        return sized

    def _sizes_from_disk(self, signature: Signature, state: dict,
                         shapes: tuple[tuple[int, ...], ...]) -> tuple | None:
        """The sizes an earlier process had made symbols for this signature, if this call fits
        them (its other sizes are theirs). Remembers the record's key."""
        key = self._index_key(signature, state)
        key = self._sizes_keys[signature] = None if key is None else sizes_key(key)
        record = None if key is None else self._disk.read_record(key)
        if record is None:
            return None
        sizes = tuple(tuple(size) for size in record["sizes"])
        return sizes if sizes_for(sizes, shapes) is sizes else None

    def _call(
        self, signature: Signature, call: FlatCall, state: dict, args: tuple, kwargs: dict
    ) -> Any:
        with self._lock:
            unsized = _unsized(signature)
            reason = self._fallbacks.get(unsized)
            broken = unsized in self._broken
            if signature.shapes is None:
                signature = self._sized(signature, call.tensors, state)
            entry = self._entries.get(signature)
            number, plan = self._plan(signature, entry) if entry is not None else (0, None)
            found = self._pairs.get((signature, plan)) if entry is not None else None
        if reason is None and not broken and entry is None and self._doomed is not None:
            self._run_doomed(signature)
            with self._lock:
                reason = self._fallbacks.get(unsized)
                broken = unsized in self._broken
        if reason is not None:
            return self._eager(args, kwargs)
        if broken:
            # Its own forward in eager PyTorch; its parts' calls reach their runtimes.
            return self.forward_fn(self.module, *args, **kwargs)
        if found is None:
            key = self._index_key(signature, state) if entry is None else None
            if key is not None and self._serve_from_index(signature, call, state, key):
                return self._call(signature, call, state, args, kwargs)
            if entry is None and self._numbers_churn(signature, call, args, kwargs):
                if self._parts:  # its own code eagerly, its parts through their runtimes
                    return self.forward_fn(self.module, *args, **kwargs)
                with self._lock:
                    self.stats.eager_steps += 1
                return self._eager(args, kwargs)
            return self._first_call(signature, call, state, args, kwargs, key)
        primals = [*state.values(), *call.tensors]
        pair = found.pair
        env = pair.sizes(primals)
        if not pair.holds_for(env):
            # The trace assumed something of the sizes that this call breaks: exact sizes.
            return self._call(signature.with_shapes(exact_shapes(call.tensors)), call, state,
                              args, kwargs)
        device = entry.device
        try:
            if signature.grad:
                step = self._step(signature, entry, pair, env, device, number)
                roots = LazyFunction.apply(step, *primals)
                if regions.serving(self):
                    regions.served(functools.partial(self._replay, step, entry, env))
            else:
                with self._lock:
                    found.stats.hits += 1
                roots = self._infer(pair, primals, env, device)
        except GraphRunError as error:
            return self._fall_back(signature, call, args, kwargs, str(error))
        except ChecksFailed as failed:  # eager raises the check's error, or reads the other value
            # Eager first: a call it refuses (a target out of range) was bad input, its error
            # the caller's, and no sign that the graph's checks fail on the data it trains on.
            result = self._eager_or_explain(args, kwargs, call)
            self._missed_check(signature, found.stats.hits,
                               f" (the last in ORT: {failed})" if str(failed) else "")
            return result
        return self._outputs(pair, entry, roots, primals, env)

    def _outputs(self, pair: GraphPair, entry: SignatureEntry, roots: Any,
                 primals: list[torch.Tensor], env: dict[str, int]) -> Any:
        """The module's result from its graphs' roots."""
        outputs = pair.module_outputs(roots, primals, env)
        return self._written(entry.template.rebuild(outputs, pair.sizes_of(env)))

    def in_region(self, region: tuple[Any, Any], args: tuple, kwargs: dict) -> Any:
        """A call inside a non-reentrant checkpoint region (`private.checkpoint_region`): in its
        forward, as any call, its way kept; in its recomputation, the way the forward ran it
        (`regions.py`)."""
        frame, recomputation = region
        if recomputation is None:
            with regions.forward_call(frame, self):
                return self(args, kwargs)
        replay = regions.recomputed_call(frame, recomputation)
        if replay is None:
            return self.forward_fn(self.module, *args, **kwargs)
        return replay(args, kwargs)

    def _replay(self, step: Step, entry: SignatureEntry, env: dict[str, int], args: tuple,
                kwargs: dict) -> Any:
        """A region call's step run again on the recomputation's inputs."""
        with self._lock:
            state = self._state.read()[0]
        primals = [*state.values(), *flatten_call(args, kwargs, self._keywords).tensors]
        roots = LazyFunction.apply(step, *primals)
        return self._outputs(step.pair, entry, roots, primals, env)

    def _missed_check(self, signature: Signature, hits: int, last: str) -> None:
        """A call that its graph's checks refuse (or would: a first call whose top-k or median
        picked among equal values) ran eagerly; `hits`: the signature's calls its graph served. The
        signature runs without graphs where such calls are not rare (`CHECK_MISSES`)."""
        unsized = _unsized(signature)
        with self._lock:
            self.stats.eager_steps += 1
            missed = self._missed_checks[unsized] = self._missed_checks.get(unsized, 0) + 1
            calls = hits + missed
        if missed >= CHECK_MISSES and missed * 5 >= calls:
            self._give_up(signature, "the checks its graph makes on tensor values (a branch or "
                          "a number read as its first call read it, a top-k's or median's "
                          f"picks free of ties) failed in {missed} of {calls} calls, each run "
                          f"again in eager PyTorch{last}")

    def _numbers_churn(self, signature: Signature, call: FlatCall, args: tuple,
                       kwargs: dict) -> bool:
        """Whether a new signature differs from others only in the values of number arguments
        that have taken `NUMBER_VALUES` values already (a temperature or a step count passed
        at every call): a graph is specialised on each number, so each value was a build that
        served no later call, and every step ran eagerly beside a queue of builds, unsaid.
        Such calls run without a build, said once: in parts where the module has parts (its
        own code, which reads the number, eagerly; its parts, which are handed tensors,
        through ORT: a gradient reversal's coefficient on a schedule), else eagerly. The
        values built before still serve."""
        numbers = {i for i, (kind, _) in enumerate(signature.constants) if kind in (int, float)}
        if not numbers:
            return False
        general = dataclasses.replace(signature, constants=tuple(
            (kind, None) if i in numbers else (kind, value)
            for i, (kind, value) in enumerate(signature.constants)))
        with self._lock:
            seen = self._numbers_seen.setdefault(general, set())
            if len(seen) >= NUMBER_VALUES:
                return True
            seen.add(signature.constants)
            if len(seen) < NUMBER_VALUES:
                return False
            changing = [i for i in sorted(numbers) if len({c[i] for c in seen}) > 1]
        constants = [p for p, leaf in enumerate(call.leaves) if not isinstance(leaf, torch.Tensor)]
        every = self._leaf_names(args, kwargs)
        names = ", ".join(every[constants[i]] for i in changing)
        self._say_in_parts_or_eagerly(
            f"{type(self.module).__name__}: {names} took {NUMBER_VALUES} values: a graph is "
            "specialised on the numbers it is given", ", so its calls with a new value run in "
            "parts", ", so its calls with a new value run in eager PyTorch (pass a number that "
            "changes from call to call as a tensor)", stacklevel=10)
        return True

    @property
    def _keywords(self) -> frozenset[str]:
        """The keywords the module's own forward names (their order is not part of a key)."""
        return named_keywords(attach.original_forward(type(self.module)))

    def _leaf_names(self, args: tuple, kwargs: dict) -> list[str]:
        """Each argument leaf's name in messages, by the module's own forward's parameters."""
        return leaf_names(args, kwargs, attach.original_forward(type(self.module)))

    def _plan(self, signature: Signature, entry: SignatureEntry) -> tuple[int, Mask | None]:
        """A call's number in the signature's forecast and the mask its forward stashes for
        (None: inference): the forecast's where its pair is at hand, else the last served.
        Called under the lock."""
        if not signature.grad:
            return 0, None
        number = entry.forecast.next_call()
        if self.options.policy != "all":
            forecast = entry.forecast.plan(number)
            if forecast is not None and (signature, forecast) in self._pairs:
                return number, forecast
        return number, entry.plan

    def _step(self, signature: Signature, entry: SignatureEntry, pair: GraphPair,
              env: dict[str, int], device: torch.device, number: int) -> Step:
        def pair_for(mask: Mask, primals: list[torch.Tensor],
                     cotangents: tuple) -> GraphPair | None:
            try:
                found = self._pair_for(signature, entry, mask, primals, cotangents, device)
            except BuildFailed as failure:
                # Found at build time, inside this backward: this step's gradients come from
                # eager PyTorch, and the next call of the signature no longer runs whole.
                self._give_up_on(signature, failure)
                return None
            if found is not None and self.options.policy != "all":
                entry.plan = mask
            return found

        def eager_backward(primals: list[torch.Tensor], cotangents: tuple,
                           generator: torch.Tensor | None,
                           create_graph: bool) -> list[torch.Tensor | None]:
            return self._eager_backward(signature, entry, primals, cotangents, generator,
                                        create_graph)

        def on_mask(mask: Mask) -> None:
            with self._lock:
                entry.forecast.record(number, mask)

        return Step(pair, entry.aliasing.root_mask(entry.differentiable), self.options.policy,
                    env, device, pair_for, self._count_recompute, on_mask, eager_backward)

    def _infer(self, pair: GraphPair, primals: list[torch.Tensor], env: dict[str, int],
               device: torch.device) -> list[torch.Tensor]:
        results = pair.forward(primals, pair.draw(env, device), device)
        pair.write_back(primals, results)
        return pair.roots(results, env)

    def _first_call(
        self, signature: Signature, call: FlatCall, state: dict, args: tuple, kwargs: dict,
        key: str | None,
    ) -> Any:
        """Run eagerly; remember the signature; build now (inference) or at backward. `key`:
        its records in the disk index, written when its graphs are built.

        A call that changed the module's own plain attributes builds nothing: those are part of
        the signature, so graphs for the one it started with would serve no later call (a
        set-up done once, as Hugging Face installing its output hooks at the first forward;
        a counter bumped at every call, whose calls then all run eagerly as they must)."""
        written = self._written_values(self.module)
        watch = Watch(list(state.values()), call.tensors)
        with checks.recording() as recorded, watching_first_call(self.module) as refuse_hooks:
            result = self._eager_or_explain(args, kwargs, call)
        if any(map(operator.is_, written, self._written_values(self.module))):
            self._drop_writes()  # this call left one as it was: part of the signature again
            return result
        with self._lock:
            modes = self._state.read()[1]
            changed = modes != signature.modes
            if changed:
                self.stats.eager_steps += 1
            self._changing_calls = self._changing_calls + 1 if changed else 0
            every_call = self._changing_calls == 2
        if every_call and not self._adopt_writes(signature.modes, modes):
            self._fall_back_for_changes(signature.modes, modes)
        if changed:
            return result
        if recorded.ties:
            # Graphs built on this call would not be eager's on it (`checks._PICKS`):
            # the next call is a first call again.
            file, line = recorded.ties[-1]
            self._missed_check(signature, 0, f" (the last: a selection at {file}:{line} picked "
                               "among equal values, in an order eager's kernel chooses)")
            return result
        try:
            template, tensors = OutputTemplate.of(self._with_writes(result, self.module))
            refuse_hooks([*state.values(), *call.tensors, *tensors])
        except (ValueError, CaptureError) as error:
            return self._fall_back(signature, call, args, kwargs, str(error), result)
        state_names = list(state)
        primals = [*state.values(), *call.tensors]
        device = _common_device(state_names, primals)
        shared, roots = aliasing(tensors, primals, inference=not signature.grad)
        with self._lock:
            self.stats.eager_steps += 1
            entry = self._entries.get(signature)
            if entry is None:
                entry = self._entries[signature] = SignatureEntry(
                    id=f"s{next(self._ids)}",
                    call=call.without_tensors(),
                    template=template,
                    differentiable=tuple(t.requires_grad for t in tensors),
                    aliasing=shared,
                    state_names=state_names,
                    device=device,
                    index_key=key,
                    reads=tuple(recorded.reads),
                )
        watch.outputs(tensors)
        if not signature.grad:
            try:
                self._pair_for(signature, entry, None, primals, None, device, watch.record())
            except BuildFailed as failure:
                return self._fall_back(signature, call, args, kwargs, str(failure), result,
                                       failure.where, failure.blamed)
            return result
        if entry.aliasing != shared:  # another thread's first call returned other aliasing
            return result
        probed = [k for k, root in enumerate(roots) if root.requires_grad]
        if not probed:
            return result
        probe = _FirstBackward(self, signature, entry, primals, len(roots), probed, device,
                               watch)
        for k, root in zip(probed, behind_probe(probe, [roots[k] for k in probed])):
            roots[k] = root
        return self._written(template.rebuild(shared.remake(tensors, roots)))

    def first_backward(self, signature: Signature, entry: SignatureEntry, mask: Mask,
                       primals: list[torch.Tensor], cotangents: tuple, device: torch.device,
                       eager: EagerRecord | None) -> None:
        """A first step's gradients arrived: build the graphs its mask (or the plan) needs;
        `eager`: what the step's forward returned, which theirs must return too."""
        if not any(mask):
            return
        wanted = mask
        if self.options.policy == "all":
            wanted = entry.aliasing.normalized(entry.differentiable)
        try:
            pair = self._pair_for(signature, entry, wanted, primals,
                                  cotangents if wanted == mask else None, device, eager)
        except BuildFailed as failure:
            self._give_up_on(signature, failure)
            return
        if pair is not None:
            with self._lock:
                entry.plan = wanted

    # ---- graphs ------------------------------------------------------------------------------

    def _pair_for(
        self,
        signature: Signature,
        entry: SignatureEntry,
        mask: Mask | None,
        primals: list[torch.Tensor],
        cotangents: tuple | None,
        device: torch.device,
        eager: EagerRecord | None = None,
    ) -> GraphPair | None:
        """The pair for (signature, mask): a hit, or a miss that builds it. None mask: the
        inference graph; `eager`: what eager PyTorch returned for `primals`, which a new pair's
        forward must return too (`verify_like_eager`).

        Waiting for builds (`Options.wait_for_builds`, strict mode), the build runs now, under
        the lock, so two threads meeting a new mask build it once; a failure raises
        `BuildFailed`. Otherwise it is queued on the builder thread (once) and None is returned:
        the caller runs this step in eager PyTorch, and the calls after the build is ready run
        through ORT (a failure is recorded then, `_built`).
        """
        key = (signature, mask)
        with self._lock:
            found = self._pairs.get(key)
            if found is not None:
                if mask is not None:
                    self.stats.hits += 1
                found.stats.hits += 1
                return found.pair
            if key in self._building:
                return None
            if mask is not None:
                self.stats.misses += 1
            indexed = self._pair_from_index(signature, entry, mask)
            if indexed is not None:
                return indexed
            # The trace swaps fake tensors into the module it traces: it traces a copy of the
            # module's structure, which another thread's eager call does not read (one that
            # traced the module itself, waiting, made that call fail on a trace tensor).
            structure = None
            with contextlib.suppress(Exception):  # a module deepcopy cannot copy waits
                structure = _structure_copy(self.module)
            if structure is None or self.options.wait_for_builds or self.options.strict:
                built = builder.run(lambda: self._build(
                    signature, entry, mask, primals, cotangents, device,
                    self.module if structure is None else structure, False, eager))
                self._add(key, built)
                return built.pair
            # The build reads this call's tensors after the caller has moved on (an optimizer
            # updates parameters in place): it gets copies.
            snapshot = [p.detach().clone().requires_grad_(p.requires_grad) for p in primals]
            given = None if cotangents is None else tuple(
                None if c is None else c.detach().clone() for c in cotangents)
            generation = self._generation
            future = builder.submit(lambda: self._build(
                signature, entry, mask, snapshot, given, device, structure, True, eager))
            self._building[key] = future
        future.add_done_callback(lambda done: self._built(key, entry, generation, done))
        return None

    def _built(self, key: tuple[Signature, Mask | None], entry: SignatureEntry,
               generation: int, done: concurrent.futures.Future) -> None:
        """A background build ended: its pair serves the next calls, or its failure is recorded.
        A build that `clear` overtook is dropped."""
        signature, mask = key
        with self._lock:
            self._building.pop(key, None)
            if generation != self._generation or done.cancelled():  # cleared, or at exit
                return
            failure = done.exception()
            if failure is None:
                self._add(key, done.result())
                if mask is not None and entry.plan is None:
                    entry.plan = mask
                return
            if isinstance(failure, ReadChanged):  # the next call of the signature builds again
                entry.reads_changed += 1
                if entry.reads_changed < READS_CHANGED:
                    return
        self._give_up_on(signature, failure)

    def _add(self, key: tuple[Signature, Mask | None], built: PairEntry,
             traced: bool = True) -> None:
        """`traced` False: served from the disk index (not an export of the signature)."""
        with self._lock:
            if built.stats.from_disk:
                self.stats.disk_hits += 1
            else:
                self.stats.builds += 1
            if traced and not any(s == key[0] for s, _ in self._pairs):
                self.stats.exports += 1
            self._pairs[key] = built

    def wait_for_builds(self, timeout: float | None = None) -> None:
        """Until the builds running or queued for this module (and its parts) have ended."""
        with self._lock:
            futures = list(self._building.values())
        with turns.between_steps():
            concurrent.futures.wait(futures, timeout=timeout)
        for _, part in self._parts or []:
            part.wait_for_builds(timeout)

    def _build(
        self,
        signature: Signature,
        entry: SignatureEntry,
        mask: Mask | None,
        primals: list[torch.Tensor],
        cotangents: tuple | None,
        device: torch.device,
        module: torch.nn.Module,
        background: bool,
        eager: EagerRecord | None,
    ) -> PairEntry:
        """Runs on the builder thread: the pair, checked, with its statistics. `background`:
        the caller has moved on (tiered execution), so the check takes its turn (`turns.py`)."""
        started = time.perf_counter()
        try:
            pair, from_disk = self._with_lines_fixed(entry, lambda fixed: self._build_pair(
                signature, entry, mask, primals, cotangents, device, module, background, eager,
                fixed))
        except GraphRunError as error:
            if device.type == "cpu" and signature.half_precision:
                # ORT's CPU provider has no bfloat16 kernels (MatMul, Add), and not every
                # float16 one: every part would build and fail the same way, one warning each
                # (14 on a 2-layer BERT under CPU autocast to bfloat16).
                raise BuildFailed(f"{error} (ONNX Runtime's CPU provider has no bfloat16 "
                                  "kernels, and not every float16 one)", whole=True) from error
            raise BuildFailed(str(error)) from error
        except (CaptureError, VerificationError) as error:
            raise BuildFailed(str(error), getattr(error, "where", None),
                              getattr(error, "sizes", False),
                              blamed=getattr(error, "blamed", True)) from error
        except ReadChanged:
            raise
        except Exception as error:  # a bug of ours: the signature stays eager, never a crash
            # in the step that waited for the build (torch failing to run a captured graph in
            # the check raised from the user's backward)
            raise BuildFailed(f"the build failed: {type(error).__name__}: {error}") from error
        stats = EntryStats(
            mask=mask,
            forward=entry.id,
            build_seconds=0.0 if from_disk else time.perf_counter() - started,
            phases=dict(pair.graphs.seconds),
            from_disk=from_disk,
        )
        return PairEntry(pair, stats)

    @staticmethod
    def _with_lines_fixed(entry: SignatureEntry,
                          build: Callable[[frozenset[tuple[str, int]]], Any]) -> Any:
        """`build(fixed)`: the build with the values from data at the lines `fixed` the first
        call's.

        Where the first call read the length of an op's result from data (`x[mask]`,
        `nonzero`, `torch.where(mask)`: `capture/selections.py`) or integers (`item()`,
        `tolist()`), the graphs make them as each call's data says (one graph for every length,
        as token routing gives each expert another count of tokens at every step), but at the
        lines of code whose trace could not go on so (`capture/data_lengths.py`), which the
        first call's values serve, with the check that a later call's data gives the same (a
        value read, `capture/checks.py`). Where a build with them each call's fails otherwise,
        every one is the first call's."""
        lines = checks.lines_from_data(entry.reads)
        while entry.fixed_lines is not None and not lines <= entry.fixed_lines:
            try:
                return build(entry.fixed_lines)
            except CaptureError as error:
                fixed = entry.fixed_lines | (error.lines & lines)
                entry.fixed_lines = fixed if fixed != entry.fixed_lines else None
            except Exception:
                entry.fixed_lines = None
        return build(lines)

    def _build_pair(
        self,
        signature: Signature,
        entry: SignatureEntry,
        mask: Mask | None,
        primals: list[torch.Tensor],
        cotangents: tuple | None,
        device: torch.device,
        module: torch.nn.Module,
        background: bool,
        eager: EagerRecord | None,
        fixed: frozenset[tuple[str, int]],
    ) -> tuple[GraphPair, bool]:
        """Capture (the values from data at the lines `fixed` the first call's); load the
        graphs from disk or export and check them. (pair, from disk)

        A background build traces after its call, while the training script goes on: a value
        the code reads (a module-level coefficient set at every step) may be another by then,
        so the trace would make the graphs of another signature than the call's. Such a build
        is dropped (`ReadChanged`)."""
        if background:
            _unchanged_since(signature, module)
        captured, key = self._trace(signature, entry, mask, primals, module, fixed)
        if background:
            _unchanged_since(signature, module)
        graphs = self._disk.load(key) if self._disk else None
        if graphs is not None:
            self._index(entry, mask, key)
            return self._pair(graphs, mask, entry), True
        graphs = export(captured, self.options.segments)
        pair = self._pair(graphs, mask, entry)
        checked = time.perf_counter()
        for which in ("forward", "backward") if graphs.backward is not None else ("forward",):
            pair.session(which, device)  # made before the turn: the training thread runs on
        with turns.check_turn() if background and mask is not None else contextlib.nullcontext():
            try:
                verify(captured, pair, primals, cotangents, device)
                if eager is not None:
                    verify_like_eager(pair, primals, eager, device)
            finally:
                # A session's binding keeps the module state it last ran on: on the builder's
                # thread, the build's copy of the parameters, for the rest of the process.
                pair.release_this_threads_bindings()
        graphs.seconds["check"] = time.perf_counter() - checked
        if self._disk:
            self._disk.store(key, graphs)
            self._index(entry, mask, key)
        return pair, False

    def _pair(self, graphs: Graphs, mask: Mask | None, entry: SignatureEntry) -> GraphPair:
        return GraphPair(graphs, mask, len(entry.state_names), self.options.arena)

    def _trace(self, signature: Signature, entry: SignatureEntry, mask: Mask | None,
               primals: list[torch.Tensor], module: torch.nn.Module,
               fixed: frozenset[tuple[str, int]]) -> tuple[Captured, str]:
        """The captured graphs and their key in the disk cache (a content hash of them)."""
        with builder.autocast(signature.autocast):
            captured = capture(
                module,
                self._forward_and_writes,
                entry.state_names,
                primals,
                entry.call.rebuild,
                tensors_of,
                mask,
                recompute=self.options.policy == "recompute",
                recompute_layers=self.options.recompute_layers,
                dynamic_dims=signature.dynamic_dims,
                sized_of=sized_numbers,
                own_roots=entry.aliasing.own_roots(),
                reads=entry.reads,
                fixed_lines=fixed,
            )
        written = dict(zip((f"{path}.{name}".lstrip(".") for path, name in self._writes),
                           self._written_values(module)))
        for gm in (captured.tidy.forward, captured.tidy.backward):
            if gm is not None and written:
                refuse_reads(gm, written)
        if captured.sized and captured.numbers != entry.template.number_count:
            raise CaptureError(
                f"the trace's result holds {captured.numbers} numbers, eager's "
                f"{entry.template.number_count}: its sizes cannot be put in their places"
            )
        if captured.aliasing != entry.aliasing:
            raise CaptureError(
                "the trace and eager PyTorch disagree on which outputs share memory (trace "
                f"{captured.aliasing.sources}, views {captured.aliasing.views}; eager "
                f"{entry.aliasing.sources}, views {entry.aliasing.views})"
            )
        if mask is not None and any(
            bit and traced != eager
            for bit, traced, eager in zip(mask, captured.differentiable, entry.differentiable)
        ):
            raise CaptureError(
                "the trace and eager PyTorch disagree on which outputs carry a gradient "
                f"(trace {captured.differentiable}, eager {list(entry.differentiable)})"
            )
        return captured, captured.fingerprint(mask, self.options.policy == "recompute",
                                              self.options.recompute_layers,
                                              self.options.segments, disk_cache.versions())

    # ---- the disk index: a new process serves known signatures without tracing -------------

    def _index_key(self, signature: Signature, state: dict) -> str | None:
        """The signature's key in the disk index (`index_key.py`); None without a disk cache or
        where something cannot be hashed deterministically (then it has no index records)."""
        if self._disk is None or self._writes:  # what it writes is no part of the key
            return None
        return index_key(self.module, signature, list(state), self.options.policy,
                         self.options.recompute_layers, self.options.segments,
                         disk_cache.versions())

    def _serve_from_index(self, signature: Signature, call: FlatCall, state: dict,
                          key: str) -> bool:
        """At a signature's first call: if the index knows it (what the entry holds, and the
        graphs of the mask its first step planned for in the process that built them), make
        its entry and pair from there, so this call runs through ORT. False: not known."""
        record = self._disk.read_record(key)
        if record is None or record["state_names"] != list(state):
            return False
        try:
            template = OutputTemplate.from_json(record["template"])
            shared = Aliasing(tuple(map(tuple, record["aliasing"]["sources"])),
                              tuple(record["aliasing"]["views"]))
        except Exception:  # a structure this process cannot rebuild: a miss, never an error
            return False
        state_names = list(state)
        primals = [*state.values(), *call.tensors]
        device = _common_device(state_names, primals)
        entry = SignatureEntry(
            id=f"s{next(self._ids)}",
            call=call.without_tensors(),
            template=template,
            differentiable=tuple(record["differentiable"]),
            aliasing=shared,
            state_names=state_names,
            device=device,
            plan=None if record["plan"] is None else tuple(record["plan"]),
            index_key=key,
            reads=None if record.get("reads") is None else tuple(map(tuple, record["reads"])),
        )
        with self._lock:
            if signature in self._entries:  # another thread's first call came first
                return True
            if self._pair_from_index(signature, entry, entry.plan) is None:
                return False
            self._entries[signature] = entry
        return True

    def _pair_from_index(self, signature: Signature, entry: SignatureEntry,
                         mask: Mask | None) -> GraphPair | None:
        """The pair the disk index names for (signature, mask), loaded without a trace; None if
        the index or the graphs are missing. Called under the lock. The index key holds the
        module's code down to its helper files (`index_key.py`), so a pair it names is served
        at once, as a pair this process built."""
        if self._disk is None or entry.index_key is None:
            return None
        record = self._disk.read_record(pair_key(entry.index_key, mask))
        graphs = self._disk.load(record["graphs"]) if record else None
        if graphs is None:
            return None
        pair = self._pair(graphs, mask, entry)
        self._add((signature, mask),
                  PairEntry(pair, EntryStats(mask=mask, forward=entry.id, from_disk=True)),
                  traced=False)
        return pair

    def _index(self, entry: SignatureEntry, mask: Mask | None, graphs_key: str) -> None:
        """Record in the disk index that (signature, mask) has the graphs `graphs_key`, and,
        once, what serving the signature needs without its first (eager) call: its output
        template, which outputs carry gradients, its state names and this mask as its plan."""
        if entry.index_key is None:
            return
        self._disk.write_record(pair_key(entry.index_key, mask), {"graphs": graphs_key})
        template = entry.template.to_json()
        if template is not None and self._disk.read_record(entry.index_key) is None:
            self._disk.write_record(entry.index_key, {
                "template": template,
                "differentiable": list(entry.differentiable),
                "aliasing": dataclasses.asdict(entry.aliasing),
                "state_names": entry.state_names,
                "plan": mask,
                "reads": None if entry.reads is None else list(map(list, entry.reads)),
            })

    def _count_recompute(self) -> None:
        with self._lock:
            self.stats.recomputes += 1

    # ---- eager -------------------------------------------------------------------------------

    def _eager_backward(self, signature: Signature, entry: SignatureEntry,
                        primals: list[torch.Tensor], cotangents: tuple,
                        generator: torch.Tensor | None,
                        create_graph: bool) -> list[torch.Tensor | None]:
        """A step's gradients by eager PyTorch: its forward again from the saved inputs (the
        random draws replayed from the generator state they were drawn from: they are drawn as
        eager draws them, `capture/draws.py`), then autograd with the step's cotangents.

        `create_graph` (a backward that is differentiable itself: a gradient penalty, MAML):
        the forward is run again from the primals themselves, not detached copies, so the
        gradients' own graph reaches the parameters and inputs, as eager's does."""
        # Every output in the mask: the roots are a training call's, as the pair's whose
        # cotangents these are (no mask would make them an inference call's, where an output
        # that alone views its root, as a Linear's of a 3-D input, is its own root).
        every_output = [True] * len(entry.aliasing.sources)
        forward = Functional(self.module, self._forward_and_writes, entry.state_names,
                             entry.call.rebuild, tensors_of, every_output)
        inputs = list(primals) if create_graph else [
            p.detach().requires_grad_(p.requires_grad) for p in primals]
        wanted = [i for i, p in enumerate(inputs) if p.requires_grad]
        device = _common_device(entry.state_names, primals)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.enable_grad(), builder.autocast(signature.autocast), unchanged(self.module):
            if generator is not None:
                generators.set_state(device, generator)
            roots = forward(*inputs)  # the roots first (`Functional`): a cotangent each
            given = [(r, c) for r, c in zip(roots, cotangents) if c is not None]
            grads = torch.autograd.grad(
                [o for o, _ in given], [inputs[i] for i in wanted], [c for _, c in given],
                allow_unused=True, create_graph=create_graph,
            )
        with self._lock:
            self.stats.eager_steps += 1
        gradients: list[torch.Tensor | None] = [None] * len(primals)
        for index, grad in zip(wanted, grads):
            gradients[index] = grad
        return gradients

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        with eager_mode():
            return self.forward_fn(self.module, *args, **kwargs)

    def _eager_or_explain(self, args: tuple, kwargs: dict, call: FlatCall) -> Any:
        """Eager's result; if eager fails, the input was bad: eager's error, with the culprit
        input and its expected dtype/device/rank in front (`errors.explain_bad_input`)."""
        try:
            return self._eager(args, kwargs)
        except Exception as eager_error:
            with self._lock:
                known = list(self._entries.keys())
            explained = explain_bad_input(eager_error, call,
                                          attach.original_forward(type(self.module)), known,
                                          self._state.read()[0])
            if explained is None:
                raise
            raise explained from eager_error

    def _fall_back(self, signature: Signature, call: FlatCall, args: tuple, kwargs: dict,
                   reason: str, result: Any = None, where: str | None = None,
                   blamed: bool = True) -> Any:
        """Run eagerly (unless `result` is eager's already) and record the fallback."""
        if result is None:
            result = self._eager_or_explain(args, kwargs, call)
        self._give_up(signature, reason, where, blamed=blamed)
        return result

    def _give_up_on(self, signature: Signature, failure: BaseException) -> None:
        """`_give_up` with what a failed build says (`BuildFailed`; another exception: its
        message)."""
        self._give_up(signature, str(failure), getattr(failure, "where", None),
                      getattr(failure, "sizes", False), getattr(failure, "whole", False),
                      getattr(failure, "blamed", True))

    def _give_up(self, signature: Signature, reason: str, where: str | None = None,
                 sizes: bool = False, whole: bool = False, blamed: bool = True) -> None:
        """The signature cannot run through ORT whole: run it in parts if the module has any
        (`parts.py`), else in eager PyTorch for good. One warning per reason.

        `where`: the submodule whose code failed. Every submodule of its class is then known to
        fail too (same code): those and the parts holding them go straight to their own parts
        or to eager PyTorch at their first call, without a capture that would fail again.
        `sizes`: the trace failed with sizes as symbols (`BuildFailed.sizes`); the signature
        is traced again for each call's exact sizes, as a signature is when a call breaks what
        its trace assumed of them, and gives up only if that fails too. `whole`: no part is
        tried (`BuildFailed.whole`). `blamed` False: `where` is named, and its class not held
        to fail (`BuildFailed.blamed`).
        """
        if sizes and signature.shapes is not None and any(map(any, signature.dynamic_dims)):
            with self._lock:
                self._exact_sizes.add(signature.with_shapes(None))
                self._entries.pop(signature, None)
                self._drop_pairs(lambda built: built == signature)
            return
        cause = reason
        reason = f"{type(self.module).__name__}: {reason}"
        culprits = self._culprits(where) if blamed else []
        if culprits:
            kind = type(self.module.get_submodule(culprits[0])).__name__
            reason += (f" (in {where}, a {kind}: every {kind} with its settings runs without "
                       "graphs of its own)")
        if self.options.strict:
            raise LazygradError(f"lazygrad (strict): cannot run through ORT: {reason}")
        parts = [] if whole else self._part_runtimes()
        if not self._record(signature, reason, bool(parts)):
            return
        for name, part in parts:
            inside = [c[len(name) + 1:] for c in culprits if c.startswith(f"{name}.")]
            if name in culprits or inside:
                part.doom(cause, "" if name in culprits else None, inside)
        if parts:
            names = [name for name, _ in parts]
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            warnings.warn(
                f"lazygrad runs this input signature in parts: {reason}. Its submodules "
                f"({shown}) run through ORT where they can, each captured on its own; the rest "
                "of its forward runs in eager PyTorch (see lazygrad.stats(model).parts)",
                GraphBreakWarning,
                stacklevel=5,
            )
            return
        warnings.warn(
            f"lazygrad falls back to eager PyTorch for this input signature: {reason}",
            FallbackWarning,
            stacklevel=5,
        )

    def _adopt_writes(self, before: tuple, after: tuple) -> bool:
        """Calls in a row change tensor attributes alone (`ModuleState.written_between`): a
        weight norm's or spectral norm's `weight` and a pruned layer's, set by their pre-hooks
        at every call, a tensor kept for a look later. They become results of each call,
        written to the module after it as eager writes them (`_written`), and leave the
        signature: the module is captured with them. Before, it ran eagerly, then in parts
        with those layers eagerly. False if anything else changed."""
        written = self._state.written_between(before, after)
        if written is None:
            return False
        paths = {id(m): name for name, m in self.module.named_modules(remove_duplicate=False)}
        with self._lock:
            self._writes = tuple(sorted((paths[key], name) for key, names in written.items()
                                        for name in names))
            self._state.exclude(written)
            self._changing_calls = 0
        return True

    def _drop_writes(self) -> None:
        """A call left a written attribute as it was (written in training only): the
        attributes are part of the signature again, and calls that keep changing them are
        adopted again (`_adopt_writes`)."""
        with self._lock:
            self._writes = ()
            self._state.exclude({})
            self.stats.eager_steps += 1

    def _forward_and_writes(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The forward whose graphs are captured: the module's result, and then the tensor
        attributes the call wrote (`_adopt_writes`), if any. A traced call that leaves one as
        it was is not captured (its first call, which did the same, drops them first:
        `_first_call`): its graphs would write back the value the attribute had at the trace
        at every step."""
        if not self._writes:
            return self.forward_fn(module, *args, **kwargs)
        before = self._written_values(module)
        result = self._with_writes(self.forward_fn(module, *args, **kwargs), module)
        for (path, name), old in zip(self._writes, before):
            # As they were: AOTAutograd runs the forward twice, and a second run that read
            # the first one's trace tensor failed unexplained; it reads the real one, which
            # `_trace` then refuses, named (`trace.refuse_reads`).
            setattr(module.get_submodule(path), name, old)
        kept = [f"{path}.{name}".lstrip(".") for (path, name), old, new
                in zip(self._writes, before, result[1]) if new is old]
        if kept:
            raise CaptureError(f"this call leaves {', '.join(kept)} as it was, where the "
                               "module's other calls write it: its graphs would write it back")
        return result

    def _with_writes(self, result: Any, module: torch.nn.Module) -> Any:
        return (result, self._written_values(module)) if self._writes else result

    def _written_values(self, module: torch.nn.Module) -> tuple:
        """The tensor attributes the module's calls write, as they are now."""
        return tuple(getattr(module.get_submodule(path), name) for path, name in self._writes)

    def _written(self, rebuilt: Any) -> Any:
        """The module's result from a rebuilt `_forward_and_writes` result, with the tensor
        attributes it holds written to the module, as the eager call would."""
        if not self._writes:
            return rebuilt
        result, values = rebuilt
        for (path, name), value in zip(self._writes, values):
            setattr(self.module.get_submodule(path), name, value)
        return result

    def _changing_call(self, args: tuple, kwargs: dict) -> Any:
        """A call of a module whose calls change its attributes: its own forward in eager
        PyTorch, its parts' calls through their runtimes. A call that changes none ends it (a
        set-up done over the first calls): the next call is captured whole again."""
        with self._lock:
            before = self._state.read()[1]
        result = self.forward_fn(self.module, *args, **kwargs)
        with self._lock:
            if self._state.read()[1] == before:
                self._changing, self._changing_calls = False, 0
        return result

    def _fall_back_for_changes(self, before: tuple, after: tuple) -> None:
        """Calls in a row change the module's own plain attributes (a counter, a tensor kept
        for a look later: an attention map, RecurrentGemma's recurrent states): each call is
        a signature of its own. Said once, with the attributes' names. A module with parts
        runs in parts while its calls change them, as a break (its parts' attributes are
        theirs to judge: those that change run eagerly, the others through ORT); before, the
        whole model ran eagerly. One without runs eagerly, as a fallback."""
        names = sorted({name for old, new in zip(before, after) for name, _ in set(new) - set(old)})
        in_parts = self._say_in_parts_or_eagerly(
            f"{type(self.module).__name__}: each call changes the module's own attributes "
            f"({', '.join(names)}), which graphs are specialised on", "",
            ", so its calls run in eager PyTorch", stacklevel=10)
        with self._lock:
            self._changing = in_parts

    def _say_in_parts_or_eagerly(self, reason: str, in_parts: str, eagerly: str,
                                 stacklevel: int) -> bool:
        """Calls that no graph serves: in parts where the module has parts (its own code
        eagerly, its parts through ORT), said once as a break with `in_parts` after the
        reason; else (or in strict mode, which raises) eagerly, said once as a fallback with
        `eagerly` after it. Whether they run in parts."""
        if self.options.strict or not self._part_runtimes():
            self._say_once(reason + eagerly, stacklevel + 1)
            return False
        self._say_in_parts(reason + in_parts, stacklevel + 1)
        return True

    def _say_in_parts(self, reason: str, stacklevel: int) -> None:
        """A break that no signature holds (every call it covers runs in parts from now on):
        counted and warned once per reason. `stacklevel`: the user's call, counted from here."""
        with self._lock:
            if reason in self.stats.reasons:
                return
            self.stats.breaks += 1
            self.stats.reasons.append(reason)
        warnings.warn(
            f"lazygrad runs this module in parts: {reason}. Its submodules run through ORT "
            "where they can, each captured on its own; the rest of its forward runs in eager "
            "PyTorch (see lazygrad.stats(model).parts)", GraphBreakWarning, stacklevel=stacklevel)

    def _say_once(self, reason: str, stacklevel: int) -> None:
        """A fallback that no signature holds (the calls it covers run eagerly before one is
        made): counted and warned once per reason; strict mode raises. `stacklevel`: the
        user's call that met it, counted from here."""
        if self.options.strict:
            raise LazygradError(f"lazygrad (strict): cannot run through ORT: {reason}")
        with self._lock:
            if reason in self.stats.reasons:
                return
            self.stats.fallbacks += 1
            self.stats.reasons.append(reason)
        warnings.warn(f"lazygrad falls back to eager PyTorch: {reason}", FallbackWarning,
                      stacklevel=stacklevel)

    def _culprits(self, where: str | None) -> list[str]:
        """The submodules (qualified names) of the same class and the same plain attributes as
        the failing one, `where`: the same code on the same settings fails alike, where another
        setting may not (BatchNorm with momentum None reads a tensor's value as a number, and
        every other BatchNorm of the model ran eagerly with it)."""
        if not where:
            return []
        failing = self.module.get_submodule(where)
        settings = plain_attributes(failing)
        return [name for name, m in self.module.named_modules()
                if name and type(m) is type(failing) and plain_attributes(m) == settings]

    def _record(self, signature: Signature, reason: str, in_parts: bool) -> bool:
        """Record a break or fallback (and drop the signature's graphs); False if the signature
        was recorded already or the reason is known (no new warning is due). It is recorded
        for the signature without its sizes: a failure that exact sizes do not mend is every
        size's."""
        signature = _unsized(signature)
        with self._lock:
            if signature in self._fallbacks or signature in self._broken:
                return False
            known = reason in self.stats.reasons
            if in_parts:
                self._broken[signature] = reason
                self.stats.breaks += 1
            else:
                self._fallbacks[signature] = reason
                self.stats.fallbacks += 1
            if not known:
                self.stats.reasons.append(reason)
            self._drop_pairs(lambda built: _unsized(built) == signature)
        return not known

    def _drop_pairs(self, of: Callable[[Signature], bool]) -> None:
        """Drop the cached pairs of the signatures `of` accepts. Under the lock."""
        for key in [k for k in self._pairs if of(k[0])]:
            self._pairs.pop(key, None)

    def doom(self, reason: str, own: str | None, inside: list[str]) -> None:
        """This module cannot be captured whole, as a failure in an enclosing module's capture
        showed: its own code failed (`own` is "") or it holds submodules whose code failed
        (`inside`, qualified names). Every signature runs in parts or in eager PyTorch, from
        its first call, silently (the enclosing module warned)."""
        with self._lock:
            self._doomed = (reason, own is not None, inside)

    def _run_doomed(self, signature: Signature) -> None:
        reason, own, inside = self._doomed
        parts = self._part_runtimes()
        self._record(signature, f"{type(self.module).__name__}: "
                     + (reason if own else f"holds a submodule that cannot be captured ({reason})"),
                     bool(parts))
        if own:
            return
        for name, part in parts:
            below = [c[len(name) + 1:] for c in inside if c.startswith(f"{name}.")]
            if name in inside or below:
                part.doom(reason, "" if name in inside else None, below)

    def _part_runtimes(self) -> list[tuple[str, Runtime]]:
        """The runtimes of the module's parts, made (and installed) at the first break."""
        with self._lock:
            if self._parts is None:
                self._parts = [
                    (name, runtime_of(part, self.options)) for name, part in parts_of(self.module)
                ]
            return self._parts


class _FirstBackward:
    """The probe of a first step: at its backward, the runtime builds for the mask seen."""

    def __init__(self, runtime: Runtime, signature: Signature, entry: SignatureEntry,
                 primals: list[torch.Tensor], count: int, probed: list[int],
                 device: torch.device, watch: Watch) -> None:
        self.runtime, self.signature, self.entry = runtime, signature, entry
        self.primals = [p.detach().requires_grad_(p.requires_grad) for p in primals]
        # The probe passes None on for an output that got no gradient, and eager's graph of that
        # output hands it on to the tensors it reads (`private.skip_hooks_without_gradient`).
        self.hooked = [p for p in primals if p.requires_grad and private.has_tensor_hooks(p)]
        self.count, self.probed, self.device, self.watch = count, probed, device, watch

    def on_backward(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        if any(grad is None for grad in grads):
            for tensor in self.hooked:
                private.skip_hooks_without_gradient(tensor)
        if torch.is_grad_enabled() or private.any_batched(grads):
            # create_graph=True: such a backward runs in eager PyTorch whatever is built (ORT's
            # records no graph), so none is built for it (a gradient penalty's signature built
            # a pair that never served); a later plain backward of the signature builds. So too
            # for a batch of cotangents under vmap, which ORT cannot take (a vectorised
            # jacobian's build failed, and its signature ran in parts from then on).
            return
        cotangents: list[torch.Tensor | None] = [None] * self.count
        for index, grad in zip(self.probed, grads):
            cotangents[index] = grad
        mask = self.entry.aliasing.output_mask([c is not None for c in cotangents])
        self.runtime.first_backward(self.signature, self.entry, mask, self.primals,
                                    tuple(cotangents), self.device, self.watch.record())


def _unsized(signature: Signature) -> Signature:
    return signature if signature.shapes is None else signature.with_shapes(None)


def _structure_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree (its modules, attributes and hooks) holding the same tensors:
    what a background trace runs, so the module itself is never touched by it."""
    shared = itertools.chain(module.parameters(), module.buffers())
    return copy.deepcopy(module, memo={id(t): t for t in shared})


def _common_device(names: list[str], tensors: list[torch.Tensor]) -> torch.device:
    if not tensors:
        return torch.device("cpu")
    device = tensors[0].device
    for index, tensor in enumerate(tensors):
        if tensor.device != device:
            name = names[index] if index < len(names) else f"argument tensor {index - len(names)}"
            raise ValueError(
                f"lazygrad: '{name}' is on {tensor.device} but the module's first tensor is on "
                f"{device}; all inputs and parameters of a lazy module must be on one device"
            )
    return device
