"""Every private PyTorch API lazygrad uses, in one place.

AOTAutograd's tracer and partitioner, fake tensors with symbolic sizes, and the ONNX exporter's
translator are the only ways to capture a joint forward/backward graph with PyTorch's own
derivative formulas and to translate it without a second trace. They are private, so the
supported torch and onnxscript versions are pinned in `pyproject.toml`, and the exactness tests
gate any upgrade. Nothing else in lazygrad imports a private torch module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# The exporter and the symbolic-shape machinery log every specialisation and skipped torchvision
# op at WARNING; for a runtime that traces on the user's behalf that is noise.
for _name in (
    "torch.onnx",
    "torch._dynamo",
    "torch.fx.experimental.symbolic_shapes",
    "torch._functorch",
    "torch.onnx._internal.exporter._registration",
    "onnx_ir._convenience",  # "an empty sequence attribute defaults to INTS", per node
):
    logging.getLogger(_name).setLevel(logging.ERROR)

_tracing = threading.local()


def _is_compiling_on_this_thread() -> bool:
    return getattr(_tracing, "active", False) or _is_compiling()


_is_compiling = torch.compiler.is_compiling


def traced_by_torch() -> bool:
    """Whether torch itself is tracing or transforming this call: torch.compile, torch.export
    and the ONNX exporter built on it, jit tracing (the TorchScript ONNX exporter), FX's
    symbolic tracing (torchvision's feature extractors), or a torch.func transform (grad,
    vmap, jacrev); or whether a dispatch mode sees its ops (a selective checkpoint's, which
    replays in the recomputation the ops it recorded in the forward; fake tensors for a memory
    estimate; a FLOP counter); or whether forward-mode AD's dual level is open (a dual input's
    tangent needs a jvp, which ORT's node has none of: such a call raised). A lazy module then
    runs as its plain self, so torch sees, differentiates or exports its PyTorch forward: run
    through ORT, torch.func raised, the exporters failed on lazygrad's own call, and a lazy
    part inside a selective checkpoint crashed the recomputation (ops it had not recorded)."""
    return (torch.compiler.is_compiling() or torch.compiler.is_exporting()
            or torch.jit.is_tracing() or torch.fx._symbolic_trace.is_fx_symbolic_tracing()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or torch._C._len_torch_dispatch_stack() > 0
            or torch.autograd.forward_ad._current_level >= 0)


def any_batched(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether any of `tensors` is a batch of tensors under vmap (torch.func's, or the one
    `torch.autograd.grad(..., is_grads_batched=True)` and a vectorised jacobian run)."""
    return any(torch._C._functorch.is_batchedtensor(tensor)
               or torch._C._functorch.is_legacy_batchedtensor(tensor)
               for tensor in tensors if tensor is not None)


def checkpoint_region() -> tuple[Any, Any] | None:
    """The non-reentrant `torch.utils.checkpoint` region this call runs in (its saved-tensor
    hooks are the innermost): (the region's frame, None) in its forward, (the frame, the id of
    the backward that recomputes it) in its recomputation; None outside a region. Read from
    the closures of the hooks torch puts there (`_checkpoint_hook`, `_recomputation_hook`)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    owner = getattr(hooks[0], "__qualname__", "").partition(".")[0]
    if owner not in ("_checkpoint_hook", "_recomputation_hook"):
        return None
    pack = inspect.unwrap(hooks[0])
    cells = {name: cell.cell_contents
             for name, cell in zip(pack.__code__.co_freevars, pack.__closure__ or ())}
    if owner == "_checkpoint_hook":
        return cells["frame"], None
    return cells["target_frame_ref"](), cells["gid"]


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Inside, on this thread only: `torch.compiler.is_compiling()` is True, so models skip
    eager-only checks on values (transformers' attention-mask fast paths) as for torch.compile;
    and AOTAutograd's pass that turns Python-float size arithmetic into tensors is off (it is
    for dynamo's float inputs, and failed with a KeyError on BatchNorm's `n / (n - 1)` of
    symbolic sizes: the arithmetic stays size arithmetic, which the exporter translates).

    Only on this thread: builds run while the training thread runs eager steps, and torch's own
    flag is process-wide. Under it transformers keeps its output collector in a global instead
    of a ContextVar, and the eager steps lost their router logits. So the flag stays off and
    `torch.compiler.is_compiling` answers per thread while a trace runs (callers look it up as
    an attribute; one trace at a time holds this)."""
    previous_tensorify = os.environ.get(_TENSORIFY)
    _tracing.active = True
    torch.compiler.is_compiling = _is_compiling_on_this_thread
    os.environ[_TENSORIFY] = "0"
    try:
        yield
    finally:
        _tracing.active = False
        torch.compiler.is_compiling = _is_compiling
        if previous_tensorify is None:
            os.environ.pop(_TENSORIFY, None)
        else:
            os.environ[_TENSORIFY] = previous_tensorify


@contextlib.contextmanager
def generators_left_alone() -> Iterator[None]:
    """Inside, AOTAutograd leaves torch's generators alone: it saves their states before a
    trace and sets them back after it (`preserve_rng_state`), which, on the builder thread,
    took back every draw the training thread made while the trace ran (its eager steps'
    Dropout), and the training's numbers were no longer eager's from then on. A trace on fake
    tensors draws nothing from them; a forward that sets them is refused
    (`python_random.py`). One trace at a time holds this."""
    import torch._functorch.aot_autograd as aot_autograd

    saved = aot_autograd.preserve_rng_state
    aot_autograd.preserve_rng_state = contextlib.nullcontext
    try:
        yield
    finally:
        aot_autograd.preserve_rng_state = saved


@contextlib.contextmanager
def recurrent_layers_as_eager() -> Iterator[None]:
    """Inside, torch's decompositions of LSTM, GRU and RNN compute what eager's kernels do:

    - an LSTM takes the per-step path (matmuls and pointwise ops), never the one through
      `mkldnn_rnn_layer`, which it picks on the CPU for an input that needs no gradient: that op
      has no ONNX translation, nor has its backward, and an LSTM over raw features fell back;
    - the dropout between stacked layers (`num_layers > 1, dropout > 0` in training) is applied.
      torch's `_rnn_helper` never applies it (its test `num_layers < i - 1` never holds), so a
      2-layer GRU or LSTM with dropout computed another function than eager's, silently. Here
      the helper runs one layer at a time, and eager's `dropout` of each layer's time-major
      output comes between them (the draws are then eager's, `draws.py`).

    The decompositions run under the Python dispatcher, that is in traces; eager calls run the
    C++ kernels, so the training thread's steps are not touched. One trace at a time holds this
    (as `compiling`)."""
    decompositions = importlib.import_module("torch._decomp.decompositions")
    chosen = decompositions.select_one_layer_lstm_function
    helper = decompositions._rnn_helper

    def layer_by_layer(input, hidden, params, has_biases, num_layers, dropout, train,
                       bidirectional, batch_first, layer_fn):
        if not (train and dropout and num_layers > 1):
            return helper(input, hidden, params, has_biases, num_layers, dropout, train,
                          bidirectional, batch_first, layer_fn)
        directions = 2 if bidirectional else 1
        input = input.transpose(0, 1) if batch_first else input
        finals: list = []
        for layer in range(num_layers):
            if layer:
                input = torch.dropout(input, dropout, train=True)
            span = slice(layer * directions, (layer + 1) * directions)
            input, last = helper(input, hidden[span], params[span], has_biases, 1, 0.0, train,
                                 bidirectional, False, layer_fn)
            finals.extend(last)
        return (input.transpose(0, 1) if batch_first else input), finals

    decompositions.select_one_layer_lstm_function = (
        lambda input, hx, params: decompositions.one_layer_lstm)
    decompositions._rnn_helper = layer_by_layer
    try:
        yield
    finally:
        decompositions.select_one_layer_lstm_function = chosen
        decompositions._rnn_helper = helper


@contextlib.contextmanager
def checkpoints_recomputed() -> Iterator[None]:
    """Inside, on this thread, the ops a `torch.utils.checkpoint` region runs are tagged to be
    recomputed in the backward (node meta "recompute", one "ac_graph_id" per region), as
    torch.compile tags them: AOTAutograd traces through a non-reentrant region as through plain
    code, and the backward saved every activation of a model trained with activation
    checkpointing to fit its batch (a 4-layer BERT's stash: 44.4 MiB against eager's 2.6).
    The partitioner saves what enters a region and recomputes the rest in the backward. The
    tags ride on the node meta that `preserve_node_meta` copies to each traced node.

    A reentrant region (`use_reentrant=True`, the default where none is passed) runs its
    function inside a custom Function whose backward calls `torch.autograd.backward`, which
    AOTAutograd's trace refuses: it is traced as its function, with eager's semantics (no
    gradient flows through it when none of its tensor inputs requires one). One trace at a time
    holds this (as `compiling`)."""
    checkpoint = importlib.import_module("torch.utils.checkpoint")
    node_meta = importlib.import_module("torch.fx.traceback")
    without_reentrant = checkpoint._checkpoint_without_reentrant_generator
    reentrant = checkpoint.CheckpointFunction
    thread = threading.get_ident()
    regions = itertools.count(1)

    @contextlib.contextmanager
    def region() -> Iterator[None]:
        meta = node_meta.current_meta  # the module's: `preserve_node_meta` replaces it
        outer = {key: meta[key] for key in _CHECKPOINT_TAGS if key in meta}
        meta["recompute"] = checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        meta["ac_graph_id"] = next(regions)
        try:
            yield
        finally:
            for key in _CHECKPOINT_TAGS:
                meta.pop(key, None)
            meta.update(outer)

    def tagged(function: Callable[..., Any], preserve_rng_state: bool,
               context_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Iterator[None]:
        if threading.get_ident() != thread:
            yield from without_reentrant(function, preserve_rng_state, context_fn, *args,
                                         **kwargs)
            return
        with region():
            if context_fn is not checkpoint.noop_context_fn:
                context_fn = _numbered(context_fn, node_meta.current_meta["ac_graph_id"])
            yield from without_reentrant(function, preserve_rng_state, context_fn, *args,
                                         **kwargs)

    class Reentrant:
        @staticmethod
        def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            if threading.get_ident() != thread:
                return reentrant.apply(function, preserve_rng_state, *args)
            differentiable = any(isinstance(arg, torch.Tensor) and arg.requires_grad
                                 for arg in args)
            with region(), torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
                return function(*args)

    checkpoint._checkpoint_without_reentrant_generator = tagged
    checkpoint.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        checkpoint._checkpoint_without_reentrant_generator = without_reentrant
        checkpoint.CheckpointFunction = reentrant


_CHECKPOINT_TAGS = ("recompute", "ac_graph_id")


def _numbered(context_fn: Callable[[], Any], number: int) -> Callable[[], Any]:
    """`context_fn` whose modes tag their region's number: a selective checkpoint's modes
    (`create_selective_checkpoint_contexts`) tag each op with the policy it chose and with
    their own `ac_graph_id`, None unless torch.compile numbered them, which the partitioner
    compares with other regions' numbers."""
    def numbered() -> Any:
        contexts = context_fn()
        for mode in contexts:
            if getattr(mode, "ac_graph_id", number) is None:
                mode.ac_graph_id = number
        return contexts

    return numbered


@contextlib.contextmanager
def float64_numbers() -> Iterator[None]:
    """While exporting, a Python float whose type the op's translation does not bind (a
    `Scalar` argument: clamp's bounds, `add`'s alpha, `masked_fill`'s value, a fill value)
    becomes a float64 constant, not the exporter's float32 one: the translation casts it to its
    tensor's type, so a float64 graph computed with it rounded to float32 (1e-8 off where eager
    is 1e-16 off). Only for graphs that compute in float64 (`to_onnx`): one export at a time."""
    building = importlib.import_module("torch.onnx._internal.exporter._building")
    ir = importlib.import_module("onnx_ir")
    determine = building._determine_input_dtype

    def wide(param: Any, arg: Any, binding: Any) -> Any:
        dtype = determine(param, arg, binding)
        if isinstance(arg, float) and dtype == ir.DataType.FLOAT \
                and param.type_constraint not in binding \
                and len(param.type_constraint.allowed_types) != 1:
            return ir.DataType.DOUBLE
        return dtype

    building._determine_input_dtype = wide
    try:
        yield
    finally:
        building._determine_input_dtype = determine


@contextlib.contextmanager
def composite_kernels(kernels: dict[Any, Callable[..., Any]]) -> Iterator[None]:
    """Inside, each op (an OpOverload) is decomposed above autograd by the kernel given, so its
    gradient comes from the formulas of the ops the kernel is written with (a fused op's own
    backward op may have no ONNX translation). Python-dispatcher kernels, so only traces see
    them; removed on the way out. One trace at a time holds this (as `compiling`).

    An op that is composite already is given the kernel at its own key; one with an autograd
    kernel of its own (replication padding) at the Autograd key, which that kernel would take
    first; and at the Autograd key too where torch put a Python kernel of its own there
    (`dropout`'s decomposition). torch's own Python kernels are put back on the way out."""
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    autograd = torch._C.DispatchKey.Autograd
    keys = {op: [composite] if op.has_kernel_for_dispatch_key(composite) else [autograd]
            for op in kernels}
    for op, found in keys.items():
        if autograd in op.py_kernels and autograd not in found:
            found.append(autograd)
    previous = {(op, key): op.py_kernels.get(key) for op, found in keys.items() for key in found}
    for op, kernel in kernels.items():
        for key in keys[op]:
            op.py_kernels.pop(key, None)
            op.py_impl(key)(kernel)
    try:
        yield
    finally:
        for (op, key), kernel in previous.items():
            op.py_kernels.pop(key, None)
            if kernel is not None:
                op.py_kernels[key] = kernel
            op._dispatch_cache.clear()


def own_composite_kernel(op: Any) -> Callable[..., Any]:
    """`op`'s own (C++) kernel at the CompositeImplicitAutograd key, past a Python kernel that
    `composite_kernels` put there: for the cases such a kernel leaves as torch computes them."""
    return functools.partial(op._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)


@contextlib.contextmanager
def functional_tensors_made() -> Iterator[dict[int, Callable[[], Any]]]:
    """Inside, every FunctionalTensor made (the tensors a trace hands to the model's code) is
    recorded, by weak reference, in the dict yielded (id -> weakref). A weak set would compare
    tensors with `==`. One trace at a time holds this (as `compiling`)."""
    cls = importlib.import_module("torch._subclasses.functional_tensor").FunctionalTensor
    made: dict[int, Callable[[], Any]] = {}
    original = cls.__new__

    def recorded(klass: type, *args: Any, **kwargs: Any) -> Any:
        tensor = original(klass, *args, **kwargs)
        made[id(tensor)] = weakref.ref(tensor)
        return tensor

    cls.__new__ = staticmethod(recorded)
    try:
        yield made
    finally:
        cls.__new__ = original


def in_backward() -> bool:
    """Whether this thread is inside an autograd backward now."""
    return torch._C._current_graph_task_id() != -1


def below_python_dispatch() -> bool:
    """Whether this thread runs with the Python dispatch key excluded: inside `torch.tensor(...)`
    of tensors, which reads each element with `item()` below it and below functionalization. A
    tensor op there met a trace's functional wrapper bare, and the process died (SIGSEGV)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python)


def queue_at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` when the backward running now ends (autograd engine's own queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


_TENSORIFY = "TENSORIFY_PYTHON_SCALARS"  # read by torch._dynamo.utils._is_tensorify_enabled


# name -> (module, attribute; None: the module itself), imported at first use (`__getattr__`)
_LAZY: dict[str, tuple[str, str | None]] = {
    "get_decompositions": ("torch._decomp", "get_decompositions"),
    "enable_python_dispatcher": ("torch._dispatch.python", "enable_python_dispatcher"),
    "aot_function": ("torch._functorch.aot_autograd", "aot_function"),
    "default_partition": ("torch._functorch.partitioners", "default_partition"),
    "PhiloxStateTracker": ("torch._decomp.decompositions_for_rng", "PhiloxStateTracker"),
    "EffectType": ("torch._library.effects", "EffectType"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "FakeTensor": ("torch._subclasses.fake_tensor", "FakeTensor"),
    "FunctionalTensor": ("torch._subclasses.functional_tensor", "FunctionalTensor"),
    "ExportedProgram": ("torch.export", "ExportedProgram"),
    "ModuleCallEntry": ("torch.export.exported_program", "ModuleCallEntry"),
    "ModuleCallSignature": ("torch.export.exported_program", "ModuleCallSignature"),
    "ExportGraphSignature": ("torch.export.graph_signature", "ExportGraphSignature"),
    "InputKind": ("torch.export.graph_signature", "InputKind"),
    "InputSpec": ("torch.export.graph_signature", "InputSpec"),
    "OutputKind": ("torch.export.graph_signature", "OutputKind"),
    "OutputSpec": ("torch.export.graph_signature", "OutputSpec"),
    "TensorArgument": ("torch.export.graph_signature", "TensorArgument"),
    "fx_traceback": ("torch.fx.traceback", None),
    "fx_config": ("torch.fx.experimental._config", None),
    "DimDynamic": ("torch.fx.experimental.symbolic_shapes", "DimDynamic"),
    "GuardOnDataDependentSymNode": ("torch.fx.experimental.symbolic_shapes",
                                    "GuardOnDataDependentSymNode"),
    "ShapeEnv": ("torch.fx.experimental.symbolic_shapes", "ShapeEnv"),
    "StatelessSymbolicContext": ("torch.fx.experimental.symbolic_shapes",
                                 "StatelessSymbolicContext"),
    "free_unbacked_symbols": ("torch.fx.experimental.symbolic_shapes", "free_unbacked_symbols"),
    "rebind_unbacked": ("torch.fx.experimental.symbolic_shapes", "rebind_unbacked"),
    "compute_unbacked_bindings": ("torch.fx.experimental.symbolic_shapes",
                                  "compute_unbacked_bindings"),
    "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
    "statically_known_true": ("torch.fx.experimental.symbolic_shapes", "statically_known_true"),
    "PythonPrinter": ("torch.utils._sympy.printers", "PythonPrinter"),
    "sympy_functions": ("torch.utils._sympy.functions", None),
    "decomposition_table": ("torch._decomp", "decomposition_table"),
    "onnx_constants": ("torch.onnx._internal.exporter._constants", None),
    "onnx_core": ("torch.onnx._internal.exporter._core", None),
    "onnx_decomp": ("torch.onnx._internal.exporter._decomp", None),
    "onnx_fx_passes": ("torch.onnx._internal.exporter._fx_passes", None),
    "onnx_registration": ("torch.onnx._internal.exporter._registration", None),
}

__all__ = ["compiling", "checkpoint_region", "recurrent_layers_as_eager",
           "checkpoints_recomputed", "float64_numbers", "composite_kernels", "in_backward",
           "queue_at_backward_end", "release_saved_tensors", "storage_id", "set_versions",
           "replay_view", *_LAZY]


def __getattr__(name: str) -> Any:
    """The private APIs above, each imported at its first use, by a build: AOTAutograd imports
    torch._dynamo, and the exporter onnxscript and torch.onnx, over 100 MiB resident, which a
    process that loads built graphs from the disk cache, or has not built yet, does not need."""
    found = _LAZY.get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = found
    value = importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def release_saved_tensors(ctx: object) -> None:
    """Drop a custom autograd Function's references to its saved tensors during its backward,
    once they were unpacked (`ctx.saved_tensors`, with PyTorch's version check): the backward
    then frees each as soon as it is done with it, as eager's nodes do. Not when the graph is
    retained (`retain_graph=True`): a later backward unpacks them again. Registering hooks on
    a saved tensor packs it (here: into nothing) and drops the node's own reference. Not a
    tensor the user's saved-tensor hooks packed (`torch.autograd.graph.save_on_cpu`, activation
    compression): it holds what they made, and torch allows one pair of hooks."""
    if torch._C._autograd._get_current_graph_task_keep_graph():
        return
    for saved in ctx._raw_saved_tensors:  # type: ignore[attr-defined]
        try:
            saved.register_hooks(_dropped, _dropped)
        except RuntimeError:  # packed by the user's hooks already
            return


class _WithGradient:
    """A tensor hook that runs only where a gradient arrives (`skip_hooks_without_gradient`)."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[torch.Tensor], Any]) -> None:
        self.hook = hook

    def __call__(self, grad: torch.Tensor | None) -> Any:
        return None if grad is None else self.hook(grad)


class _Arrival:
    """A tensor hook that notes whether a gradient arrived at the accumulation it precedes."""

    __slots__ = ("arrived",)

    def __init__(self) -> None:
        self.arrived = True

    def __call__(self, grad: torch.Tensor | None) -> None:
        self.arrived = grad is not None


class _AfterGradient:
    """A post-accumulate-grad hook that runs only where its tensor's `_Arrival` saw a gradient."""

    __slots__ = ("hook", "arrival")

    def __init__(self, hook: Callable[[torch.Tensor], Any], arrival: _Arrival) -> None:
        self.hook, self.arrival = hook, arrival

    def __call__(self, tensor: torch.Tensor) -> Any:
        return self.hook(tensor) if self.arrival.arrived else None


def has_tensor_hooks(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has hooks of `Tensor.register_hook` or of
    `register_post_accumulate_grad_hook`."""
    return bool(tensor._backward_hooks) or bool(tensor._post_accumulate_grad_hooks)


def skip_hooks_without_gradient(tensor: torch.Tensor) -> None:
    """From now on `tensor`'s hooks (`register_hook`, `register_post_accumulate_grad_hook`) run
    only where a gradient arrives.

    PyTorch runs a tensor's hooks with None, and a leaf's post-accumulate hooks with its `.grad`
    as it was, where a custom autograd Function (a lazy call's node, a first step's probe) gives
    it no gradient: a parameter that only outputs outside the grad mask read, or that no output
    reads. Eager's graph never reaches such a tensor, so none of its hooks run, and a hook
    written for eager (`p.register_hook(lambda g: g.clamp(-1, 1))`) failed on None. A hook
    registered later is wrapped at the next backward that needs it."""
    hooks = tensor._backward_hooks
    if hooks:
        for key, hook in list(hooks.items()):
            if not isinstance(hook, (_WithGradient, _Arrival)):
                hooks[key] = _WithGradient(hook)
    after = tensor._post_accumulate_grad_hooks
    if not after:
        return
    unwrapped = [(key, hook) for key, hook in after.items() if not isinstance(hook, _AfterGradient)]
    if unwrapped:
        arrival = next((hook.arrival for hook in after.values()
                        if isinstance(hook, _AfterGradient)), None)
        if arrival is None:
            arrival = _Arrival()
            tensor.register_hook(arrival)
        for key, hook in unwrapped:
            after[key] = _AfterGradient(hook, arrival)


def storage_id(tensor: torch.Tensor) -> int | None:
    """The identity of the storage behind `tensor` (a `.data` assignment replaces it; an
    in-place op does not); None for a tensor without one (a subclass that wraps others)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Set the tensors' autograd version counters: a probe that hands the very tensors back,
    marked as changed in place (`function.behind_probe`), puts back the bump that marking
    made, so the eager graph's saved tensors stay valid and only the user's own in-place
    change is seen, as in eager."""
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


def replay_view(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The view ops that made `view` from its base, applied to `base` (AOTAutograd regenerates
    its aliased outputs so)."""
    return view._view_func(base)


def _dropped(_: object) -> None:
    return None
