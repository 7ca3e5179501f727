"""Stage 1, trace: (module, call, mask) -> AOTAutograd's joint graph, on fake tensors.

The module runs once under `torch.func.functional_call` with fake parameters and fake inputs
whose dimensions are symbols, so no real computation happens, sizes stay symbolic (Python values
derived from sizes are fine), and a branch on tensor *values* raises instead of being baked in.
Outputs outside the grad mask are detached before the trace: no cotangent exists for them and
their heads are not differentiated.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import operator
import threading
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules import module as torch_module
from torch.nn.utils.rnn import PackedSequence

from lazygrad import global_hooks, user_code
from lazygrad.capture import (
    aliases,
    checks,
    data_lengths,
    draws,
    lowerings,
    private,
    quiet,
    symbols,
)
from lazygrad.capture.errors import CaptureError
from lazygrad.eager import eager_mode

aten = torch.ops.aten


@dataclasses.dataclass
class Traced:
    """What the trace saw: the joint graph (or the inference graph) and the call's metadata."""

    joint: fx.GraphModule  # primals [+ tangents] -> mutated inputs, outputs [+ grads]
    training: bool  # joint holds a backward (tangents and gradients) too
    num_forward_outputs: int  # mutated inputs + user outputs
    mutated: list[int]  # primal indices the forward updates in place (in output order)
    outputs: list[torch.Tensor]  # the fake outputs (their shapes, dtypes, requires_grad)
    locations: symbols.Locations  # size symbol -> (primal, dim) where a call's value is read
    guards: list[str]  # conditions on the sizes (Python code) under which the graph is valid
    untranslatable: list[tuple[str, str]]  # (op, submodule) of ATen ops ONNX may not translate
    mode: Any  # the trace's FakeTensorMode: what its tensors are told apart by (escapes.py)


@functools.cache
def decompositions(wide: bool = False) -> dict:
    """The exporter's own decomposition table, applied at trace time, plus three of ours.

    `nll_loss_forward`: torchlib (onnxscript 0.7.2) translates it with a fake `total_weight`
    (1.0), which only its backward reads: gradients came out 32x too large.
    `_native_batch_norm_legit_functional` (BatchNorm in training): ONNX's BatchNormalization
    updates the running variance with the biased batch variance, torch with the unbiased one
    (the check caught it). `hardtanh_backward` (ReLU6's, clamp's): torchlib lets the gradient
    through where the input equals a bound, torch does not (ReLU6 at exactly 0 or 6), and its
    masks are float32 constants, which ORT refused beside a float16 gradient (MobileNet-V2
    under autocast fell back). And the ops ONNX cannot express as they are (lowerings.py).

    `wide` (a float64 call, `in_float64`): also the activations whose ONNX ops take their
    numbers as float32 attributes (LeakyRelu's slope, Elu's alpha, HardSigmoid's 1/6), which
    a float64 model would compute with, 1e-8 off where eager is 1e-16 off; decomposed, their
    numbers are float64 constants (`to_onnx._numbers_as_tensors`). And the normalizations,
    whose translations type their statistics as float32 (ORT refused the graph).
    """
    registry = onnx_registry()
    implemented = set(private.onnx_decomp.get_onnx_implemented_overloads(registry))
    table = private.onnx_decomp.create_onnx_friendly_decomposition_table(implemented)
    table.update(private.get_decompositions([
        aten.nll_loss_forward,
        aten._native_batch_norm_legit_functional,
        aten.hardtanh_backward,
    ]))
    # Lifted whole, so that their draws are eager's (draws.py).
    for op in [aten.native_dropout.default, *draws.NOT_DECOMPOSED]:
        table.pop(op, None)
    # `torch.tensor(n)` of a size stays a constant of the trace, as AOTAutograd tracks it, so
    # the number read back from it is n: DeBERTa slices its position table by
    # `torch.tensor(min(length, span))` (decomposed, the slice's bound was unknown data).
    table.pop(aten.lift_fresh.default, None)
    table.update(lowerings.TABLE)
    if wide:
        table.update(private.get_decompositions(FLOAT64_DECOMPOSED))
    return table


# Ops a float64 graph computes otherwise than eager, or not at all, unless decomposed.
FLOAT64_DECOMPOSED = [
    getattr(aten, name) for name in (
        "leaky_relu", "leaky_relu_backward", "elu", "elu_backward", "celu", "selu",
        "softplus", "softplus_backward", "hardtanh",
        "hardsigmoid", "hardsigmoid_backward", "hardswish", "hardswish_backward",
        "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
        "native_group_norm_backward", "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training", "native_batch_norm_backward",
    )
]


def in_float64(values: Iterable[object]) -> bool:
    """Whether a graph of these inputs computes in float64: it has floating-point ones, all
    float64 (a float64 model). A float32 model with a float64 buffer is not: its graphs stay
    as they were (the float64 treatment decomposes its normalizations, and a float64 constant
    meets its float32 ops)."""
    dtypes = [v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return bool(dtypes) and all(dtype == torch.float64 for dtype in dtypes)


_REGISTRY = None
_REGISTERED: set[str] = set()  # lazygrad's own translations in the registry (grouped_mm.py)
_registry_lock = threading.Lock()


def onnx_registry() -> Any:
    """torchlib's translations, plus grouped matmul's (grouped_mm.py): those of a library's
    custom ops join once the library has defined them, so each call looks again. And
    `sort.stable` (lowerings.stable_sort) with torchlib's `sort`: ONNX's TopK, which breaks
    ties by index, is a stable sort. And `prims.prod`, which torch's decompositions of `prod`
    and `cumprod` reduce with (products.py)."""
    # Imported here, as the exporter is (`private`): its translations need onnxscript, which a
    # process that only loads built graphs never imports.
    from lazygrad.capture import grouped_mm, products

    global _REGISTRY
    with _registry_lock:
        if _REGISTRY is None:
            _REGISTRY = private.onnx_registration.ONNXRegistry.from_torchlib(
                opset_version=private.onnx_constants.TORCHLIB_OPSET
            )
            (sort,) = _REGISTRY.get_decomps(aten.sort.default)
            _REGISTRY.register_op(aten.sort.stable, sort.onnx_function)
            _REGISTRY.register_op(torch.ops.prims.prod.default, products.prims_prod)
        grouped_mm.register(_REGISTRY, _REGISTERED)
        return _REGISTRY


def _unread_draws_picked(joint: fx.GraphModule) -> None:
    """A Dropout whose result nothing reads (Canine drops out a tensor it never uses) still
    draws in eager PyTorch, and stays in the joint graph as a random op; AOTAutograd's
    partitioner takes a tuple result with no reader for a tensor and failed ("Expected
    native_dropout to be a tensor"), and the model ran in parts. Each such result gets a reader
    of its first element, as a read one has: the partitioner keeps it, and its draw is made
    as eager makes it (`draws.py`)."""
    for node in list(joint.graph.nodes):
        value = node.meta.get("val")
        if node.op == "call_function" and not node.users and isinstance(value, (tuple, list)) \
                and value and isinstance(value[0], torch.Tensor):
            with joint.graph.inserting_after(node):
                first = joint.graph.call_function(operator.getitem, (node, 0))
            first.meta["val"] = value[0]


def fake_primals(
    primals: Sequence[torch.Tensor], dynamic: Sequence[Sequence[bool]],
    mode: private.FakeTensorMode
) -> list[torch.Tensor]:
    """Fake copies of `primals`; the sizes flagged in `dynamic` (per primal, per dimension) are
    symbols."""
    fakes = []
    for tensor, dims in zip(primals, dynamic):
        if any(dims):
            context = private.StatelessSymbolicContext(dynamic_sizes=[
                private.DimDynamic.DYNAMIC if flag else private.DimDynamic.STATIC
                for flag in dims])
            fake = mode.from_tensor(tensor, symbolic_context=context)
        else:
            fake = mode.from_tensor(tensor, static_shapes=True)
        if tensor.requires_grad:
            fake.requires_grad_(True)
        fakes.append(fake)
    return fakes


_lock = threading.Lock()


def trace(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    dynamic: Sequence[Sequence[bool]],
    training: bool,
    module: torch.nn.Module,
) -> Traced:
    """Trace `fn(*primals)` (flat tensors in, flat tensors out) with AOTAutograd.

    `training`: trace the joint forward+backward (the primals that require grad are
    differentiated); otherwise the inference graph alone. `module`: the module `fn` runs, whose
    submodules name where a failure happened (`CaptureError.where`). One trace at a time in the
    process: functorch's transform levels and the compiling flag are not per thread.
    """
    with _lock, module_paths(module) as names:
        # Non-fake inputs allowed: a tensor the forward makes from Python values (torch.tensor of a
        # size) is a constant of the trace, and the size it read becomes a guard.
        mode = private.FakeTensorMode(
            shape_env=private.ShapeEnv(duck_shape=False), allow_non_fake_inputs=True
        )
        fakes = fake_primals(primals, dynamic, mode)
        where = symbols.locations(fakes)
        if not training:
            fakes = [f.detach() for f in fakes]
        versions = [f._version for f in fakes]
        got: dict[str, Any] = {}

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            got["joint"], got["num_forward_outputs"] = joint, kwargs["num_fwd_outputs"]
            data_lengths.traced(mode.shape_env)
            _unread_draws_picked(joint)
            return private.default_partition(joint, joint_inputs, **kwargs)

        def keep_first(gm: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
            if "inference" not in got and "joint" not in got:
                data_lengths.traced(mode.shape_env)
            got.setdefault("inference", gm)
            return data_lengths.rerun(gm, mode.shape_env)

        compiled = private.aot_function(
            fn, keep_first, keep_first, partition_fn=partition,
            decompositions=decompositions(in_float64(primals))
        )
        try:
            # Grad mode on: builds may run inside a backward, where it is off. The fake mode active
            # around the call, or factories in the model (torch.arange) would make real tensors.
            # SDPA as its math: the fused kernels' backward ops have no ONNX translation.
            # The Python dispatcher: AOTAutograd runs the traced forward once more on the fakes
            # for its outputs, and without it some meta kernels (index's broadcast, as in
            # bilinear upsampling) reach C++ ops that refuse symbolic sizes. LSTM, GRU and RNN
            # as eager computes them (`private.recurrent_layers_as_eager`); fused ops as what
            # they compute (`lowerings.COMPOSITE`). Never beside an eager run of the user's code
            # on another thread (`user_code.py`: code that runs as compiling may assume so).
            # Anomaly mode's warning about a backward that cannot be traced is not shown: the
            # error is the reason lazygrad gives (`quiet.py`). A `torch.compile`d submodule runs
            # its own code (dynamo's frame, saving and restoring the generators' state around
            # it, was refused as a draw).
            with user_code.traced(), quiet.ignoring("Error detected in"), \
                    torch.compiler.set_stance("force_eager"), \
                    torch.enable_grad() if training else torch.no_grad(), mode, \
                    private.compiling(), private.generators_left_alone(), \
                    private.enable_python_dispatcher(), sdpa_kernel(SDPBackend.MATH), \
                    private.recurrent_layers_as_eager(), \
                    private.composite_kernels(lowerings.COMPOSITE), \
                    private.checkpoints_recomputed(), checks.deferred():
                outputs = compiled(*fakes)
        except CaptureError:
            raise
        except Exception as error:
            where = failing_submodule(error, names)
            if _given_a_packed_sequence(error, names):
                raise CaptureError(
                    "an RNN given a PackedSequence (`pack_padded_sequence`): its batch sizes are "
                    "data, which a graph would read as sizes; such calls run in eager PyTorch",
                    where, blamed=False) from error
            raise CaptureError(describe(error), where,
                               sizes=any(map(any, dynamic)),
                               lines=data_lengths.lines_branched_on(error),
                               blamed=not isinstance(error, private.GuardOnDataDependentSymNode)
                               ) from error
        finally:  # AOTAutograd leaves the trace's fake seed and offset (and its fake mode) there
            private.PhiloxStateTracker.reset()
        mutated = [i for i, (f, v) in enumerate(zip(fakes, versions)) if f._version != v]
        outputs = list(outputs)
        graph = got.get("joint") or got["inference"]
        _refuse_assumed_lengths(graph, mode)
        untranslatable = _untranslatable(graph)
        try:
            guards = size_guards(mode.shape_env, where)
        except CaptureError as error:
            raise CaptureError(str(error), sizes=True) from error
        if training and "joint" in got:
            return Traced(got["joint"], True, got["num_forward_outputs"], mutated, outputs, where,
                          guards, untranslatable, mode)
        return Traced(got["inference"], False, len(mutated) + len(outputs), mutated, outputs, where,
                      guards, untranslatable, mode)


_MODULE = "lazygrad_module"


@contextlib.contextmanager
def module_paths(module: torch.nn.Module) -> Iterator[dict[int, str]]:
    """While tracing, every node records the qualified name of the innermost submodule whose
    code emitted it (backward nodes: that of their forward node), in `meta["custom"]`; nodes
    of the module's own code record none. Yields id(submodule) -> name ("" for `module`).

    With it a failure names the submodule to capture around, instead of trying every level
    of the module tree in turn. Global module hooks, active only during the trace and only for
    this thread and this module's submodules.
    """
    names: dict[int, str] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        names.setdefault(id(submodule), name)
    thread = threading.get_ident()
    meta = private.fx_traceback.current_meta
    outer: list[Any] = []

    @global_hooks.own
    def enter(submodule: torch.nn.Module, _args: Any) -> None:
        name = names.get(id(submodule))
        if name and threading.get_ident() == thread:
            outer.append(meta.get("custom"))
            meta["custom"] = {**(meta.get("custom") or {}), _MODULE: name}

    @global_hooks.own
    def leave(submodule: torch.nn.Module, _args: Any, _result: Any) -> None:
        if names.get(id(submodule)) and threading.get_ident() == thread:
            previous = outer.pop()
            if previous is None:
                meta.pop("custom", None)
            else:
                meta["custom"] = previous

    with private.fx_traceback.preserve_node_meta():
        entering = torch_module.register_module_forward_pre_hook(enter)
        leaving = torch_module.register_module_forward_hook(leave, always_call=True)
        try:
            yield names
        finally:
            entering.remove()
            leaving.remove()


def submodule_of(node: fx.Node) -> str:
    """The submodule whose code emitted `node` (`module_paths`); "" for the module's own."""
    return (node.meta.get("custom") or {}).get(_MODULE, "")


def failing_submodule(error: BaseException, names: dict[int, str]) -> str | None:
    """The innermost submodule (qualified name) whose forward was running when `error` was
    raised during the trace; "" for the module's own code, None if none of its frames are."""
    found = None
    frame = error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        frame = frame.tb_next
    return found


def _given_a_packed_sequence(error: BaseException, names: dict[int, str]) -> bool:
    """Whether the innermost submodule running when `error` was raised was given a
    `PackedSequence` (its failure is then that call's, not its class's: the same LSTM given
    padded tensors traces)."""
    given = False
    frame = error.__traceback__
    while frame is not None:
        local = frame.tb_frame.f_locals
        if id(local.get("self")) in names:
            given = any(isinstance(value, PackedSequence) for value in local.values())
        frame = frame.tb_next
    return given


def _refuse_assumed_lengths(graph: fx.GraphModule, mode: Any) -> None:
    """A graph runs no assertion: one whose trace assumed a condition of a length or integer
    read from data (`data_lengths.py`) that it does not check is not built; those values are
    to be the first call's."""
    lines, unknown = data_lengths.lines_assumed(mode.shape_env)
    if lines or unknown:
        where = next((submodule_of(node) for node in graph.graph.nodes
                      if node.meta.get("val") is not None
                      and private.free_unbacked_symbols(node.meta["val"])), None)
        raise CaptureError(
            "the forward assumes a condition of a length or integer read from data (a reshape "
            "by it, `torch._check`), which its graph would not check at each call", where,
            lines=lines)


def refuse_updates_a_checkpoint_repeats(traced: Traced) -> None:
    """A buffer a `torch.utils.checkpoint` region updates in training (a BatchNorm's running
    statistics, in DenseNet's memory-efficient layers or a ResNet checkpointed to fit its
    batch): eager runs the region again in the backward, updating it a second time, where a
    graph updates it once (a helper's probe: running means up to 28% off eager's, silently).
    Refused: the region's modules then run as parts inside eager's checkpoint, which runs them
    again as it runs eager's."""
    if not traced.training or not traced.mutated:
        return
    output = next(node for node in reversed(traced.joint.graph.nodes) if node.op == "output")
    updates = pytree.tree_leaves(output.args)[:len(traced.mutated)]
    if any(isinstance(node, fx.Node) and "ac_graph_id" in node.meta for node in updates):
        raise CaptureError(
            "a buffer is updated inside a torch.utils.checkpoint region in training (a "
            "BatchNorm's running statistics): eager updates it again when the backward runs "
            "the region again, a graph would update it once")


def refuse_state_read_around_the_swap(gm: fx.GraphModule, module: torch.nn.Module) -> None:
    """The trace swaps trace tensors into the module it traces; a parameter or buffer that
    still reached the graph as a constant was read around that swap, from a module object the
    code holds outside the traced tree (an instance `forward` closing over a submodule, a
    global naming the model, while a copy of the tree is traced). Baked in, its value would
    never change and it would get no gradient; so would the weights of a module kept in a
    list outside the tree (an EMA teacher), and any tensor that requires grad held outside
    it. Called once the module holds its own tensors again (`unchanged`: with tied weights
    the swap may leave trace tensors in it until then)."""
    state = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
             if t.numel()}
    if next(_constants_of(gm, state), None) is not None:
        raise CaptureError(
            "the forward reads a parameter or buffer through a module object held outside "
            "the module's tree (a closure or a global naming it), which a trace would bake "
            "in as a constant without its gradient"
        )
    held = {t.untyped_storage().data_ptr() for kept in _modules_kept_outside(module)
            for t in (*kept.parameters(), *kept.buffers()) if t.numel()}
    if next(_constants_of(gm, held), None) is not None:
        raise CaptureError(
            "the forward runs a module kept outside its tree (in a list, tuple or dict "
            "attribute: an EMA teacher), whose weights a graph would hold as constants while "
            "they change; register it as a submodule, or call it outside the model")
    if any(constant.requires_grad for constant in _constants(gm)):
        raise CaptureError(
            "the forward reads a tensor that requires grad and is none of the module's "
            "parameters (one of a module kept outside its tree, in a list or a plain "
            "attribute): eager gives it a gradient, a graph would hold it as a constant; "
            "register its module as a submodule, or `requires_grad_(False)` it")


def _modules_kept_outside(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The modules the tree's modules hold in their list, tuple and dict attributes that are
    not in the tree."""
    tree = {id(m) for m in module.modules()}
    for owner in module.modules():
        for value in vars(owner).values():
            if type(value) in (list, tuple, dict):
                items = value.values() if type(value) is dict else value
                yield from (item for item in items
                            if isinstance(item, torch.nn.Module) and id(item) not in tree)


def refuse_reads(gm: fx.GraphModule, written: dict[str, torch.Tensor]) -> None:
    """Tensor attributes each call writes (by qualified name, as they were before the trace)
    must not be read before they are written: the graph would hold the value at the trace as
    a constant, where each eager call reads the last call's (a recurrent state kept on the
    module). The failure is the attribute's module's, wherever it was read."""
    names = {t.untyped_storage().data_ptr(): name for name, t in written.items()
             if isinstance(t, torch.Tensor) and t.numel()}
    for storage in _constants_of(gm, names):
        name = names[storage]
        raise CaptureError(
            f"the forward reads its tensor attribute {name!r} and then replaces it: a graph "
            "would hold the value it had at the trace, where each call reads the last "
            "call's", name.rpartition(".")[0])


def _constants_of(gm: fx.GraphModule, storages: Container[int]) -> Iterator[int]:
    """The storages (data pointers) among `storages` of the real tensors `gm` holds as
    constants."""
    return (storage for constant in _constants(gm)
            if (storage := constant.untyped_storage().data_ptr()) in storages)


def _constants(gm: fx.GraphModule) -> Iterator[torch.Tensor]:
    """The real tensors `gm` holds as constants: values a trace read from outside its inputs
    and baked in."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor) and value.numel() and not isinstance(
                value, private.FakeTensor):
            yield value


def _untranslatable(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """Ops of `gm` that the exporter's registry has no translation for, with their submodule.

    An op outside ATen (a library's custom op, such as transformers' `grouped_mm_fallback`)
    never translates: the capture fails here, before partitioning and export. An ATen op may
    still be handled by the exporter's own passes, so it is only listed: if the export then
    fails, the list names where."""
    registry = onnx_registry()
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if registry.is_registered(target):
            continue
        if target.namespace not in ("aten", "prims"):
            raise CaptureError(f"the op {target} has no ONNX translation", submodule_of(node))
        found.append((str(target), submodule_of(node)))
    return found


def size_guards(shape_env: private.ShapeEnv, where: symbols.Locations) -> list[str]:
    """What the trace assumed about the input sizes, as Python conditions over the symbols.

    A branch on a size (`if x.size(1) != 1`), a `torch._assert` on one, or two sizes that had to
    match (broadcasting) make the graph valid only where the same holds: such a call gets a
    graph of its own. The symbols' ranges (a dynamic size is at least 2) are conditions too.
    """
    import sympy  # at a build only, as in symbols.py

    conditions = []
    for name in where:
        symbol = sympy.Symbol(name, integer=True, positive=True)
        symbol = next((s for s in shape_env.var_to_range if s.name == name), symbol)
        replaced = shape_env.replace(symbol)
        if replaced != symbol:
            conditions.append(sympy.Eq(symbol, replaced))
        bounds = shape_env.var_to_range.get(symbol)
        if bounds is not None:
            if isinstance(bounds.lower, sympy.Integer):
                conditions.append(symbol >= int(bounds.lower))
            if isinstance(bounds.upper, sympy.Integer):
                conditions.append(symbol <= int(bounds.upper))
    for guard in shape_env.guards:
        conditions.append(shape_env.replace(guard.expr))
    codes = []
    for condition in conditions:
        if condition in (sympy.true, True):
            continue
        if condition in (sympy.false, False):
            raise CaptureError(f"the trace holds for no size: {condition}")
        if not {s.name for s in condition.free_symbols} <= set(where):
            raise CaptureError(f"a size condition on internal sizes: {condition}")
        codes.append(symbols.to_code(condition))
    return sorted(set(codes))


def describe(error: Exception) -> str:
    """A one-paragraph reason for a failed trace, naming data-dependent constructs plainly."""
    message = str(error).strip().split("\n\n")[0]
    if (
        isinstance(error, private.GuardOnDataDependentSymNode)
        or type(error).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException")
        or "data-dependent" in message
        or "data dependent" in message
        or ".numpy()" in message
    ):
        return (
            "the forward (or its backward) depends on tensor values (a branch or loop on a "
            "tensor's value, a size from data, a value read through NumPy) that one graph "
            "cannot capture "
            f"as its first call read them: {type(error).__name__}: {message}"
        )
    return f"tracing failed: {type(error).__name__}: {message}"


@contextlib.contextmanager
def unchanged(module: torch.nn.Module) -> Iterator[None]:
    """Restore every submodule's attributes on exit: its parameters, buffers and children (by
    identity), its other attributes (one the trace set is removed), and the items of its list
    and dict attributes.

    functional_call swaps the module's tensors for the trace's and swaps them back; with a module
    shared under several names and tied weights, a failure half-way could leave a trace tensor
    inside the real module. A module may also keep its tensors in a list of its own, which the
    swap updates in passing (an RNN's `_flat_weights` kept the trace's tensors, and the next
    call failed on them). Whatever happens in the block, the module comes out as it went in.
    """
    saved = []
    for m in module.modules():
        saved.append((m.__dict__, dict(m.__dict__)))
        saved.extend((value, value.copy()) for value in m.__dict__.values()
                     if type(value) in (list, dict, collections.OrderedDict))
    try:
        yield
    finally:
        for container, items in saved:
            if isinstance(container, list):
                if len(container) != len(items) or any(map(operator.is_not, container, items)):
                    container[:] = items
            elif container.keys() != items.keys() or any(
                    container[k] is not v for k, v in items.items()):
                container.clear()
                container.update(items)


def _contents(args: tuple, kwargs: dict) -> tuple:
    """What the call's containers hold: their structure and the identity of every item."""
    leaves, structure = pytree.tree_flatten((args, kwargs))
    return structure, list(map(id, leaves))


class _Original(torch.nn.Module):
    """Runs the module's original forward, bypassing its own hooks and its lazy forward.

    The user's hooks run around the lazy call already; traced too, they would apply twice.
    """

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.inner = module
        self.forward_fn = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        swapped = _state_entries(self.inner)
        result = self.forward_fn(self.inner, *args, **kwargs)
        _replaced_buffers_written(swapped)
        return result


def _state_entries(module: torch.nn.Module) -> list[tuple[str, dict, str, torch.Tensor]]:
    """(qualified name, the dict holding it, its key, the tensor) of every parameter and buffer
    of the tree: during a trace, the tensors `functional_call` swapped in."""
    entries = []
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            entries.extend((f"{prefix}.{key}".lstrip("."), table, key, tensor)
                           for key, tensor in table.items() if tensor is not None)
    return entries


def _replaced_buffers_written(swapped: list[tuple[str, dict, str, torch.Tensor]]) -> None:
    """A forward that assigns a buffer a new tensor (`self.x_min = self.x_min * 0.95 + ...`, a
    running range) replaced the tensor `functional_call` swapped in, which it then restored:
    the trace saw no update, and ORT steps left the buffer at its first value, silently. Such
    a value is written into the swapped-in buffer instead, an update of it the graph makes as
    it makes a running mean's; a parameter replaced, or a buffer by one it cannot hold, is
    refused."""
    for name, table, key, tensor in swapped:
        new = table[key] if key in table else None  # noqa: SIM401 (TorchScript: no `get`)
        if new is tensor:
            continue
        if isinstance(new, torch.nn.Parameter) or isinstance(tensor, torch.nn.Parameter):
            raise CaptureError(f"the forward replaces its parameter {name!r}: a graph cannot")
        if not isinstance(new, torch.Tensor) or new.requires_grad or (
                new.shape, new.dtype, new.device) != (tensor.shape, tensor.dtype, tensor.device):
            given = (f"a tensor of {new.dtype}{list(new.shape)}"
                     f"{' that requires grad' if new.requires_grad else ''}"
                     if isinstance(new, torch.Tensor) else type(new).__name__)
            raise CaptureError(
                f"the forward replaces its buffer {name!r} with {given} where it held "
                f"{tensor.dtype}{list(tensor.shape)}: a graph updates a buffer in place")
        with torch.no_grad():
            tensor.copy_(new)
        table[key] = tensor


class Functional:
    """fn(*state, *call tensors) -> the roots of the forward's flat tensor outputs, then every
    output that is not a root itself, detached (`aliases.py`): the roots carry the gradients,
    and the traced graph holds each view, from which `tidy` reads how to make it in torch.
    After a run, `aliasing`, `differentiable` (per output), `numbers` (how many the result
    holds), `sized` (those that are sizes, as code) and `checked` say what it saw. `checked`:
    the forward made argument checks on values (`checks.py`); whether they all held is its
    last result, after the outputs.

    `forward(module, *args, **kwargs)` is the module's original forward; `sized_of` finds the
    numbers of a result that are sizes. A root that no output in `mask` is made from is
    detached; `mask` None: an inference trace (no root is).

    `own_roots`: the outputs that eager made as tensors of their own. The trace may make such
    an output a view of an intermediate where eager does not: the decomposition of a batched
    `matmul` folds the batch and views the result back, where eager's kernel returns an
    `_unsafe_view`, which is no view. Such an output is cloned, so it is a root here as in
    eager (`h @ h.transpose(1, 2)` returned by a module ran in parts before).

    `reads`: what the first call read from tensors' values (`checks.recording`): the trace
    reads each value as that call did (a branch taken the same way, a size, a list), and the
    check that the value is the same joins the others; the lengths of ops' results and
    integers read by `item()` or `tolist()` are each call's, but at the lines `fixed_lines`
    (`data_lengths.py`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        state_names: Sequence[str],
        rebuild: Callable[[list[torch.Tensor]], tuple[tuple, dict]],
        tensors_of: Callable[[Any], list[torch.Tensor]],
        mask: Sequence[bool] | None,
        sized_of: Callable[[Any], tuple[int, list[tuple[int, Any]]]] = lambda result: (0, []),
        own_roots: Sequence[bool] = (),
        reads: checks.Reads | None = None,
        fixed_lines: Collection[tuple[str, int]] = (),
    ) -> None:
        self.original = _Original(module, forward)
        self.reads, self.fixed_lines = reads, fixed_lines
        self.names = [f"inner.{name}" for name in state_names]
        self.rebuild, self.tensors_of, self.sized_of = rebuild, tensors_of, sized_of
        self.mask = mask
        self.own_roots = own_roots
        self.aliasing: aliases.Aliasing | None = None
        self.differentiable: list[bool] = []
        self.sized: list[tuple[int, str]] = []
        self.numbers = 0
        self.checked = False

    def __call__(self, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count = len(self.names)
        state = dict(zip(self.names, primals[:count]))
        args, kwargs = self.rebuild(list(primals[count:]))
        given = _contents(args, kwargs)
        storages = list(map(private.storage_id, primals))
        with eager_mode(), checks.kept(self.reads, self.fixed_lines) as made:
            result = functional_call(self.original, state, args, kwargs, tie_weights=True)
        replaced = [i for i, (primal, storage) in enumerate(zip(primals, storages))
                    if private.storage_id(primal) != storage]
        if replaced:
            names = [self.names[i].removeprefix("inner.") if i < count else f"input {i - count}"
                     for i in replaced]
            raise CaptureError(
                f"the forward replaces the `.data` of {', '.join(names)} (a constraint applied "
                "in the forward): the trace drops it, and ORT steps would leave it as it was")
        if _contents(args, kwargs) != given:
            raise CaptureError(
                "the forward changes a list or dict it was given (an auxiliary loss appended to "
                "a list argument): ORT steps run no Python, so the caller's would stay as it was"
            )
        outputs = self.tensors_of(result)
        if len(self.own_roots) == len(outputs):
            outputs = [output.clone() if own and output._base is not None else output
                       for output, own in zip(outputs, self.own_roots)]
        self.aliasing, roots = aliases.aliasing(outputs, primals, inference=self.mask is None)
        self.numbers, sized = self.sized_of(result)
        self.sized = [(at, symbols.to_code(value)) for at, value in sized]
        self.differentiable = [bool(o.requires_grad) for o in outputs]
        if self.mask is not None:
            wanted = self.aliasing.root_mask(self.mask)
            roots = [root if keep else root.detach() for root, keep in zip(roots, wanted)]
        others = [o.detach() for o, (kind, _), view in zip(outputs, self.aliasing.sources,
                                                           self.aliasing.views)
                  if kind == "primal" or view]
        self.checked = bool(made)
        return (*roots, *others, *([checks.all_held(made)] if made else []))

