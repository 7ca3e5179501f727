"""The runtime of one lazy module: decides which graphs serve a call, and runs them.

Deciding is kept here: the call's signature, whether its graphs exist, the mask the forward
plans for (the policy), building a pair for a new mask, fallback. Building is `capture`'s job,
checking `verify`'s, running `GraphPair`'s and `Step`'s.

The life of a signature: its first call runs in eager PyTorch (its grad mask is not known yet),
with a `MaskProbe` on the outputs; at that step's backward the mask is known and the one pair of
graphs for it is built. From the next call on, the forward runs in ORT with the graphs of the
mask last seen, and a backward with another mask is a miss that builds (or finds) its pair.
An inference call (no grad) builds its forward graph right after its first, eager, call.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
from collections.abc import Hashable
from typing import Any

import torch

from lazygrad import builder, disk_cache
from lazygrad.capture import CaptureError, capture, export
from lazygrad.eager import eager_mode, in_eager_mode
from lazygrad.errors import FallbackWarning, LazygradError, explain_bad_input
from lazygrad.function import LazyFunction, MaskProbe
from lazygrad.graph_cache import GraphCache
from lazygrad.graph_pair import GraphPair
from lazygrad.module_state import ModuleState
from lazygrad.options import Options
from lazygrad.outputs import OutputTemplate, tensors_of
from lazygrad.session import GraphRunError
from lazygrad.signature import FlatCall, LastSignature, Signature, flatten_call
from lazygrad.stats import EntryStats, Stats
from lazygrad.step import Step
from lazygrad.verify import VerificationError, verify

ORIGINAL_FORWARD = "_lazygrad_original_forward"
Mask = tuple[bool, ...]


def original_forward(cls: type) -> Any:
    """The forward a lazy class (or a class with a lazy instance) had before it was made lazy."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return klass.__dict__.get(ORIGINAL_FORWARD, klass.__dict__["forward"])
    raise TypeError(f"lazygrad: {cls.__name__} defines no forward")


@dataclasses.dataclass
class SignatureEntry:
    """What is known about one input signature once its first call has run."""

    id: str  # short name in the statistics
    call: FlatCall  # the call's structure and constants (no tensors)
    template: OutputTemplate
    differentiable: Mask  # per flat tensor output: eager's requires_grad
    state_names: list[str]
    plan: Mask | None = None  # the mask the forward stashes for; None until a backward


@dataclasses.dataclass
class PairEntry:
    pair: GraphPair
    stats: EntryStats


class BuildFailed(Exception):
    """Graphs for a signature could not be built or checked: the signature falls back."""


class Runtime:
    """Owns one module's caches and statistics; called in place of the module's forward."""

    def __init__(self, module: torch.nn.Module, options: Options) -> None:
        self.module = module
        self.options = options
        self._init_caches()

    def _init_caches(self) -> None:
        self.forward_fn = original_forward(type(self.module))
        self._state = ModuleState(self.module)
        self._signatures = LastSignature()
        self._lock = threading.RLock()
        self.stats = Stats()
        self._entries: dict[Signature, SignatureEntry] = {}
        self._pairs = GraphCache(self.options.cache_size, self._count_eviction)
        self._fallbacks: dict[Signature, str] = {}
        self._ids = itertools.count()
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

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = Stats()
            for entry in self._pairs.values():
                entry.stats.hits = 0

    def snapshot(self) -> Stats:
        with self._lock:
            entries = [dataclasses.replace(e.stats) for e in self._pairs.values()]
            return dataclasses.replace(self.stats, entries=entries)

    def _count_eviction(self, key: Hashable, value: Any) -> None:
        self.stats.evictions += 1

    # ---- the call ----------------------------------------------------------------------------

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if in_eager_mode():
            return self._eager(args, kwargs)
        call = flatten_call(args, kwargs)
        with self._lock:
            state, modes = self._state.read()
            signature = self._signatures.of(call, state, modes)
        return self._call(signature, call, state, args, kwargs)

    def _call(
        self, signature: Signature, call: FlatCall, state: dict, args: tuple, kwargs: dict
    ) -> Any:
        with self._lock:
            reason = self._fallbacks.get(signature)
            entry = self._entries.get(signature)
            plan = (entry.plan if signature.grad else None) if entry is not None else None
            found = self._pairs.get((signature, plan)) if entry is not None else None
        if reason is not None:
            return self._eager(args, kwargs)
        if found is None:
            return self._first_call(signature, call, state, args, kwargs)
        primals = [*state.values(), *call.tensors]
        pair = found.pair
        env = pair.sizes(primals)
        if not pair.holds_for(env):
            # The trace assumed something of the sizes that this call breaks: exact sizes.
            return self._call(signature.with_shapes(call.tensors), call, state, args, kwargs)
        device = _common_device(entry.state_names, primals)
        try:
            if signature.grad:
                outputs = LazyFunction.apply(self._step(signature, entry, pair, env, device),
                                             *primals)
            else:
                with self._lock:
                    found.stats.hits += 1
                outputs = self._infer(pair, primals, env, device)
        except GraphRunError as error:
            return self._fall_back(signature, call, args, kwargs, str(error))
        return entry.template.rebuild(list(outputs))

    def _step(self, signature: Signature, entry: SignatureEntry, pair: GraphPair,
              env: dict[str, int], device: torch.device) -> Step:
        def pair_for(mask: Mask, primals: list[torch.Tensor], cotangents: tuple) -> GraphPair:
            return self._pair_for(signature, entry, mask, primals, cotangents, device)

        def on_mask(mask: Mask) -> None:
            if self.options.policy != "all":
                entry.plan = mask

        return Step(pair, entry.differentiable, self.options.policy, env, device, pair_for,
                    self._count_recompute, on_mask)

    def _infer(self, pair: GraphPair, primals: list[torch.Tensor], env: dict[str, int],
               device: torch.device) -> list[torch.Tensor]:
        results = pair.forward(primals, pair.draw(env, device), device)
        pair.write_back(primals, results)
        return pair.outputs(results, env)

    def _first_call(
        self, signature: Signature, call: FlatCall, state: dict, args: tuple, kwargs: dict
    ) -> Any:
        """Run eagerly; remember the signature; build now (inference) or at backward."""
        result = self._eager_or_explain(args, kwargs, call)
        try:
            template, tensors = OutputTemplate.of(result)
        except ValueError as error:
            return self._fall_back(signature, call, args, kwargs, str(error), result)
        with self._lock:
            self.stats.eager_steps += 1
            entry = self._entries.get(signature)
            if entry is None:
                entry = self._entries[signature] = SignatureEntry(
                    id=f"s{next(self._ids)}",
                    call=call.without_tensors(),
                    template=template,
                    differentiable=tuple(t.requires_grad for t in tensors),
                    state_names=list(state),
                )
        primals = [*state.values(), *call.tensors]
        device = _common_device(entry.state_names, primals)
        if not signature.grad:
            try:
                self._pair_for(signature, entry, None, primals, None, device)
            except BuildFailed as failure:
                return self._fall_back(signature, call, args, kwargs, str(failure), result)
            return result
        probed = [i for i, t in enumerate(tensors) if t.requires_grad]
        if not probed:
            return result
        probe = _FirstBackward(self, signature, entry, primals, len(tensors), probed, device)
        for index, tensor in zip(probed, MaskProbe.apply(probe, *(tensors[i] for i in probed))):
            tensors[index] = tensor
        return template.rebuild(tensors)

    def first_backward(self, signature: Signature, entry: SignatureEntry, mask: Mask,
                       primals: list[torch.Tensor], cotangents: tuple,
                       device: torch.device) -> None:
        """A first step's gradients arrived: build the graphs its mask (or the plan) needs."""
        if not any(mask):
            return
        wanted = entry.differentiable if self.options.policy == "all" else mask
        try:
            self._pair_for(signature, entry, wanted, primals,
                           cotangents if wanted == mask else None, device)
        except BuildFailed as failure:
            self._record_fallback(signature, str(failure))
            return
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
    ) -> GraphPair:
        """The pair for (signature, mask): a hit, or a miss that builds it (under the lock, so
        two threads meeting a new mask build it once). None mask: the inference graph."""
        key = (signature, mask)
        with self._lock:
            found = self._pairs.get(key)
            if found is not None:
                if mask is not None:
                    self.stats.hits += 1
                found.stats.hits += 1
                return found.pair
            if mask is not None:
                self.stats.misses += 1
            built = self._build(signature, entry, mask, primals, cotangents, device)
            if not any(s == signature for s, _ in self._pairs):
                self.stats.exports += 1
            self._pairs[key] = built
            return built.pair

    def _build(
        self,
        signature: Signature,
        entry: SignatureEntry,
        mask: Mask | None,
        primals: list[torch.Tensor],
        cotangents: tuple | None,
        device: torch.device,
    ) -> PairEntry:
        started = time.perf_counter()
        try:
            pair, from_disk = builder.run(
                lambda: self._build_pair(signature, entry, mask, primals, cotangents, device)
            )
        except (CaptureError, VerificationError, GraphRunError) as error:
            raise BuildFailed(str(error)) from error
        if from_disk:
            self.stats.disk_hits += 1
        else:
            self.stats.builds += 1
        stats = EntryStats(
            mask=mask,
            forward=entry.id,
            build_seconds=0.0 if from_disk else time.perf_counter() - started,
            phases=dict(pair.graphs.seconds),
            from_disk=from_disk,
        )
        return PairEntry(pair, stats)

    def _build_pair(
        self,
        signature: Signature,
        entry: SignatureEntry,
        mask: Mask | None,
        primals: list[torch.Tensor],
        cotangents: tuple | None,
        device: torch.device,
    ) -> tuple[GraphPair, bool]:
        """Capture; load the graphs from disk or export and check them. (pair, from disk)"""
        with builder.autocast(signature.autocast):
            captured = capture(
                self.module,
                self.forward_fn,
                entry.state_names,
                primals,
                entry.call.rebuild,
                tensors_of,
                mask,
                recompute=self.options.policy == "recompute",
                static_shapes=signature.shapes is not None,
            )
        if mask is not None and any(
            bit and traced != eager
            for bit, traced, eager in zip(mask, captured.differentiable, entry.differentiable)
        ):
            raise CaptureError(
                "the trace and eager PyTorch disagree on which outputs carry a gradient "
                f"(trace {captured.differentiable}, eager {list(entry.differentiable)})"
            )
        key = captured.fingerprint(mask, self.options.policy == "recompute",
                                   disk_cache.versions())
        graphs = self._disk.load(key) if self._disk else None
        if graphs is not None:
            return GraphPair(graphs, mask, persistent=len(entry.state_names)), True
        graphs = export(captured)
        pair = GraphPair(graphs, mask, persistent=len(entry.state_names))
        checked = time.perf_counter()
        verify(captured, pair, primals, cotangents, device)
        graphs.seconds["check"] = time.perf_counter() - checked
        if self._disk:
            self._disk.store(key, graphs)
        return pair, False

    def _count_recompute(self) -> None:
        with self._lock:
            self.stats.recomputes += 1

    # ---- eager -------------------------------------------------------------------------------

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
            explained = explain_bad_input(eager_error, call, self.forward_fn, known,
                                          self._state.read()[0])
            if explained is None:
                raise
            raise explained from eager_error

    def _fall_back(self, signature: Signature, call: FlatCall, args: tuple, kwargs: dict,
                   reason: str, result: Any = None) -> Any:
        """Run eagerly (unless `result` is eager's already) and record the fallback."""
        if result is None:
            result = self._eager_or_explain(args, kwargs, call)
        self._record_fallback(signature, reason)
        return result

    def _record_fallback(self, signature: Signature, reason: str) -> None:
        reason = f"{type(self.module).__name__}: {reason}"
        if self.options.strict:
            raise LazygradError(f"lazygrad (strict): cannot run through ORT: {reason}")
        with self._lock:
            if signature in self._fallbacks:
                return
            warned = reason in self._fallbacks.values()
            self._fallbacks[signature] = reason
            self.stats.fallbacks += 1
            for key in [k for k in self._pairs if k[0] == signature]:
                self._pairs.pop(key, None)
        if warned:
            return  # one warning per reason, however many signatures share it
        warnings.warn(
            f"lazygrad falls back to eager PyTorch for this input signature: {reason}",
            FallbackWarning,
            stacklevel=5,
        )


class _FirstBackward:
    """The probe of a first step: at its backward, the runtime builds for the mask seen."""

    def __init__(self, runtime: Runtime, signature: Signature, entry: SignatureEntry,
                 primals: list[torch.Tensor], count: int, probed: list[int],
                 device: torch.device) -> None:
        self.runtime, self.signature, self.entry = runtime, signature, entry
        self.primals = [p.detach().requires_grad_(p.requires_grad) for p in primals]
        self.count, self.probed, self.device = count, probed, device

    def on_backward(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        cotangents: list[torch.Tensor | None] = [None] * self.count
        for index, grad in zip(self.probed, grads):
            cotangents[index] = grad
        mask = tuple(c is not None for c in cotangents)
        self.runtime.first_backward(self.signature, self.entry, mask, self.primals,
                                    tuple(cotangents), self.device)


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
