"""The runtime of one lazy module: decides which graph serves a call, and runs it.

Deciding (signature -> exported graph, mask -> backward graph, policy -> what to stash) is kept
here; running graphs is `session.py`'s job, building them `export.py`'s and `gradient.py`'s.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import onnx
import torch

from lazygrad import disk_cache, onnx_graph, stash
from lazygrad.errors import FallbackWarning, LazygradError, explain_bad_input
from lazygrad.export import ExportedGraph, ExportError, eager_mode, export_module, in_eager_mode
from lazygrad.function import LazyFunction
from lazygrad.gradient import (
    BackwardGraph,
    GradientError,
    build_backward,
    differentiable_outputs,
    hoisted_type,
)
from lazygrad.graph_cache import GraphCache
from lazygrad.module_state import ModuleState
from lazygrad.options import Options
from lazygrad.session import GraphRunError, GraphSession
from lazygrad.signature import FlatCall, Signature, flatten_call, signature_of
from lazygrad.stats import EntryStats, Stats
from lazygrad.step import Step


@dataclasses.dataclass
class SignatureEntry:
    """Everything known about one input signature: its graph, what is trainable, what to stash."""

    exported: ExportedGraph
    types: dict[str, onnx.TypeProto]
    trainable: list[str]  # graph inputs whose tensors require grad
    differentiable: tuple[bool, ...]  # per graph output
    available: set[str]  # forward tensors a backward graph may read instead of recomputing
    random: tuple[str, ...]  # outputs of random ops: always stashed, never recomputed
    prediction: tuple[bool, ...]  # the mask the next backward is expected to have
    fingerprint: str  # content hash of the forward graph: the on-disk cache key's root
    # Shape nodes hoisted out of backward graphs, by output: the forward runs those it stashes.
    hoisted: dict[str, onnx.NodeProto] = dataclasses.field(default_factory=dict)
    sessions: dict[Hashable, GraphSession] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BackwardEntry:
    graph: BackwardGraph
    stats: EntryStats
    stash: tuple[str, ...]  # what a forward keeps for this graph: planned once, read every step
    sessions: dict[Hashable, GraphSession] = dataclasses.field(default_factory=dict)


ORIGINAL_FORWARD = "_lazygrad_original_forward"


def original_forward(cls: type) -> Callable:
    """The forward a lazy class (or a class with a lazy instance) had before it was made lazy."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return klass.__dict__.get(ORIGINAL_FORWARD, klass.__dict__["forward"])
    raise TypeError(f"lazygrad: {cls.__name__} defines no forward")


class Runtime:
    """Owns one module's caches and statistics; called in place of the module's forward."""

    def __init__(self, module: torch.nn.Module, options: Options) -> None:
        self.module = module
        self.options = options
        self._init_caches()

    def _init_caches(self) -> None:
        self.forward_fn = original_forward(type(self.module))
        self._state = ModuleState(self.module)
        self._lock = threading.RLock()
        self.stats = Stats()
        self._signatures = GraphCache(self.options.cache_size, self._count_eviction)
        self._fallbacks: dict[Signature, str] = {}
        self._backward = GraphCache(self.options.cache_size, self._count_eviction)
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
            self._signatures.clear()
            self._backward.clear()
            self._fallbacks.clear()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = Stats()
            for entry in self._backward.values():
                entry.stats.hits = 0

    def snapshot(self) -> Stats:
        with self._lock:
            entries = [dataclasses.replace(e.stats) for e in self._backward.values()]
            return dataclasses.replace(self.stats, entries=entries)

    def _count_eviction(self, key: Hashable, value: Any) -> None:
        self.stats.evictions += 1

    # ---- the call ----------------------------------------------------------------------------

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if in_eager_mode():
            return self._eager(args, kwargs)
        call = flatten_call(args, kwargs)
        # The state is read under the lock because an export (in another thread) swaps the
        # module's parameters for trace tensors while it runs.
        with self._lock:
            state, modes = self._state.read()
            signature = signature_of(call, state, modes)
        return self._call(signature, call, state, args, kwargs)

    def _call(
        self, signature: Signature, call: FlatCall, state: dict, args: tuple, kwargs: dict
    ) -> Any:
        """Run the call on the graph of `signature`, exported first if the signature is new."""
        try:
            # Exporting under the lock makes two threads that meet a new signature export once.
            with self._lock:
                fell_back = signature in self._fallbacks
                entry = None if fell_back else (
                    self._signatures.get(signature) or self._prepare(signature, call, state)
                )
        except (ExportError, GradientError) as error:
            return self._fall_back(signature, args, kwargs, error)
        if entry is None:
            return self._eager(args, kwargs)
        if entry.exported.static_shapes and signature.shapes is None:
            # The trace baked sizes in: one graph per set of sizes.
            return self._call(signature.with_shapes(call.tensors), call, state, args, kwargs)
        return self._run(entry, signature, call, state, args, kwargs)

    def _run(
        self,
        entry: SignatureEntry,
        signature: Signature,
        call: FlatCall,
        state: dict,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        inputs = _graph_feeds(entry.exported, state, call)
        device = _common_device(entry.exported.graph_inputs, inputs)
        try:
            if self._needs_grad(entry):
                step = Step(self, signature, entry, device)
                outputs = LazyFunction.apply(step, *inputs)
            else:
                session = self.session(
                    entry.sessions,
                    ("forward", ()),
                    lambda: stash.forward_graph(entry, ()),
                    device,
                    entry,
                )
                outputs = session.run(dict(zip(entry.exported.graph_inputs, inputs)))
        except GraphRunError as error:
            return self._fall_back(signature, args, kwargs, error)
        return entry.exported.outputs.rebuild(list(outputs))

    def _needs_grad(self, entry: SignatureEntry) -> bool:
        # As ORTModule does: eval mode and no_grad run the plain inference graph.
        return (
            torch.is_grad_enabled()
            and self.module.training
            and bool(entry.trainable)
            and any(entry.differentiable)
        )

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        with eager_mode():
            return self.forward_fn(self.module, *args, **kwargs)

    def _fall_back(self, signature: Signature, args: tuple, kwargs: dict, error: Exception) -> Any:
        """Run eagerly; if eager fails too the input is bad, and eager's error is the one raised
        (with the culprit input and its expected dtype/device/rank in front where they differ
        from the exported signature: `errors.explain_bad_input`)."""
        try:
            result = self._eager(args, kwargs)
        except Exception as eager_error:
            with self._lock:
                known = list(self._signatures.keys())
            explained = explain_bad_input(eager_error, flatten_call(args, kwargs), self.forward_fn,
                                          known, self._state.read()[0])
            if explained is None:
                raise
            raise explained from eager_error
        reason = f"{type(self.module).__name__}: {error}"
        if self.options.strict:
            raise LazygradError(f"lazygrad (strict): cannot run through ORT: {reason}") from error
        with self._lock:
            if signature not in self._fallbacks:
                self._fallbacks[signature] = reason
                self._signatures.pop(signature, None)
                self.stats.fallbacks += 1
                warnings.warn(
                    f"lazygrad falls back to eager PyTorch for this input signature: {reason}",
                    FallbackWarning,
                    stacklevel=4,
                )
        return result

    # ---- graphs ------------------------------------------------------------------------------

    def _prepare(self, signature: Signature, call: FlatCall, state: dict) -> SignatureEntry:
        """Export the signature's forward graph and plan its first backward."""
        exported = export_module(self.module, self.forward_fn, state, call)
        types = onnx_graph.tensor_types(exported.model)
        feeds = dict(zip(exported.graph_inputs, _graph_feeds(exported, state, call)))
        trainable = [
            name for name, tensor in feeds.items()
            if tensor.requires_grad and tensor.is_floating_point()
        ]
        differentiable_names = set(differentiable_outputs(exported.model, trainable, types))
        differentiable = tuple(name in differentiable_names for name in exported.graph_outputs)
        random = onnx_graph.random_outputs(exported.model.graph.node)
        entry = SignatureEntry(
            exported=exported,
            types=types,
            trainable=trainable,
            differentiable=differentiable,
            available=stash.readable_by_backward(self.options.policy, exported, random),
            random=tuple(sorted(random)),
            prediction=differentiable,
            fingerprint=disk_cache.fingerprint(exported.model),
        )
        # A trace that baked sizes in serves these sizes only: it is filed under them, and the
        # size-free key marks the signature as one that needs sizes (see `_call`).
        key = signature.with_shapes(call.tensors) if exported.static_shapes else signature
        with self._lock:
            self.stats.exports += 1
            if trainable and any(differentiable):
                # Builds the graph of the all-outputs mask: it plans the first step's stash and
                # proves the signature differentiable before anything runs through ORT.
                self.backward_entry(key, entry, differentiable, count=False)
            self._signatures[key] = entry
            self._signatures.setdefault(signature, entry)
        return entry

    def backward_entry(
        self,
        signature: Signature,
        entry: SignatureEntry,
        mask: tuple[bool, ...],
        count: bool,
    ) -> BackwardEntry:
        """The cached backward graph for `mask`, built on a miss. `count`: a real lookup."""
        key = (signature, mask)
        with self._lock:
            found = self._backward.get(key)
            if found is not None:
                if count:
                    self.stats.hits += 1
                    found.stats.hits += 1
                return found
            if count:
                self.stats.misses += 1
            outputs = [n for n, bit in zip(entry.exported.graph_outputs, mask) if bit]
            disk_key = disk_cache.cache_key(
                entry.fingerprint, outputs, entry.trainable, self.options.policy
            )
            graph = self._disk.load(disk_key) if self._disk else None
            from_disk = graph is not None
            if graph is not None:
                self.stats.disk_hits += 1
            else:
                graph = build_backward(
                    entry.exported.model, outputs, entry.trainable, entry.available, entry.types
                )
                self.stats.builds += 1
                if self._disk:
                    self._disk.store(disk_key, graph)
            for node in graph.forward_nodes:
                entry.hoisted[node.output[0]] = node
                entry.types[node.output[0]] = hoisted_type(node)
            stats = EntryStats(
                mask=mask,
                forward=entry.fingerprint[:8],
                build_seconds=graph.build_seconds,
                from_disk=from_disk,
            )
            inputs = set(entry.exported.graph_inputs)
            kept = {name for name in graph.reads if name not in inputs} | set(entry.random)
            built = BackwardEntry(graph, stats, tuple(sorted(kept)))
            self._backward[key] = built
            return built

    def session(
        self,
        sessions: dict[Hashable, GraphSession],
        key: Hashable,
        model: Callable[[], onnx.ModelProto],
        device: torch.device,
        entry: SignatureEntry,
    ) -> GraphSession:
        """The session for `key` on `device` in `sessions`, made from `model()` the first time."""
        key = (key, _device_key(device))
        with self._lock:
            found = sessions.get(key)
            if found is None:
                state = frozenset(entry.exported.graph_inputs[: len(entry.exported.state_names)])
                found = sessions[key] = GraphSession(model(), device, persistent=state)
            return found

    def count_recompute(self) -> None:
        with self._lock:
            self.stats.recomputes += 1

    def plan_stash(self, signature: Signature, entry: SignatureEntry) -> tuple[str, ...]:
        """Forward tensors (intermediates and outputs) to keep for the expected backward."""
        if self.options.policy == "recompute":
            return entry.random
        mask = entry.differentiable if self.options.policy == "all" else entry.prediction
        return self.backward_entry(signature, entry, mask, count=False).stash


def _graph_feeds(
    exported: ExportedGraph, state: dict[str, torch.Tensor], call: FlatCall
) -> list[torch.Tensor]:
    tensors = call.tensors
    return [state[n] for n in exported.state_names] + [tensors[i] for i in exported.input_positions]


def _common_device(names: list[str], tensors: list[torch.Tensor]) -> torch.device:
    if not tensors:
        return torch.device("cpu")
    device = tensors[0].device
    for name, tensor in zip(names, tensors):
        if tensor.device != device:
            raise ValueError(
                f"lazygrad: '{names[0]}' is on {device} but '{name}' is on {tensor.device}; "
                "all inputs and parameters of a lazy module must be on one device"
            )
    return device


def _device_key(device: torch.device) -> Hashable:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return ("cuda", index, torch.cuda.current_stream(index).cuda_stream)
    return (device.type, device.index)
