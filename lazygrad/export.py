"""Stage 1: module + one call -> an ONNX forward graph whose parameters are graph inputs.

Parameters and buffers are inputs rather than initializers so that each step feeds the live torch
tensors (optimizer updates are seen, nothing is copied). The TorchScript exporter is used: it is
fast (0.05-0.7 s here) and is the one ORT's gradient builder was exercised with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import onnx
import torch
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from lazygrad.onnx_graph import with_optional_outputs
from lazygrad.rewrites import decompose_cross_entropy
from lazygrad.signature import FlatCall, flatten

# 20: GELU exports as one Gelu op (ORT's gradient builder knows it), so the backward reads its
# input alone instead of the five intermediates of the Erf decomposition that opset 17 emits.
OPSET = 20

# Non-tensor output leaves returned as they were traced: values that cannot hide a tensor.
PLAIN_OUTPUT_TYPES = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size
)

_eager = threading.local()
# torch.onnx.export keeps its settings (opset, training mode, "exporting now") in module globals,
# and warnings.catch_warnings swaps process-wide state: one export at a time, whatever the thread.
_export_lock = threading.Lock()


class ExportError(RuntimeError):
    """The module cannot be captured as one ONNX graph (the runtime falls back to eager)."""


@contextlib.contextmanager
def eager_mode() -> Iterator[None]:
    """Within this block every lazy module runs its original PyTorch forward.

    Used while tracing (a lazy submodule must be traced, not run through ORT) and for fallback.
    """
    previous = getattr(_eager, "active", False)
    _eager.active = True
    try:
        yield
    finally:
        _eager.active = previous


def in_eager_mode() -> bool:
    return getattr(_eager, "active", False)


@dataclasses.dataclass
class OutputTemplate:
    """How to rebuild the module's return value from the graph's flat tensor outputs."""

    structure: pytree.TreeSpec
    constants: dict[int, Any]  # leaf position -> non-tensor leaf
    tensor_positions: list[int]

    def __post_init__(self) -> None:
        # `return a, b, c` of tensors, the common case, is rebuilt without pytree.
        self.plain_tuple = (
            self.structure.type is tuple
            and not self.constants
            and all(child.is_leaf() for child in self.structure.children_specs)
        )

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        if self.plain_tuple:
            return tuple(tensors)
        leaves: list[Any] = [None] * (len(self.constants) + len(self.tensor_positions))
        for position, value in self.constants.items():
            leaves[position] = value
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.structure)


@dataclasses.dataclass
class ExportedGraph:
    """The forward graph and how its inputs and outputs map to the module's."""

    model: onnx.ModelProto
    state_names: list[str]  # module state fed as graph inputs, in graph-input order
    input_positions: list[int]  # positions in the call's tensor list fed as graph inputs
    graph_inputs: list[str]  # names, state first then call tensors
    graph_outputs: list[str]
    outputs: OutputTemplate
    static_shapes: bool  # the trace baked sizes in: reuse only for the same sizes


def state_name(name: str) -> str:
    return f"state.{name}"


def input_name(position: int) -> str:
    return f"input.{position}"


class _Original(torch.nn.Module):
    """Runs the module's original forward, bypassing the module's own hooks and lazy forward.

    The user's hooks run around the lazy call already; tracing them too would apply them twice.
    """

    def __init__(self, module: torch.nn.Module, forward: Callable) -> None:
        super().__init__()
        self.inner = module
        self.forward_fn = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_fn(self.inner, *args, **kwargs)


class _Traced(torch.nn.Module):
    """Flat tensors in (state, then call tensors), flat tensors out: what the exporter traces."""

    def __init__(self, original: _Original, state_names: list[str], call: FlatCall) -> None:
        super().__init__()
        self.original = original
        self.state_names = state_names
        self.call = call
        self.template: OutputTemplate | None = None

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count = len(self.state_names)
        state = {f"inner.{n}": t for n, t in zip(self.state_names, flat[:count])}
        args, kwargs = self.call.rebuild(list(flat[count:]))
        # torch.func.functional_call refuses to run under the tracer; its reparametrisation
        # context is what it uses inside, and works there. tie_weights, as functional_call does:
        # a tied weight (an MLM decoder sharing the word embedding) is named once in `state`,
        # and each of its aliases must read the same graph input, or the gradient through the
        # unnamed alias is lost (the live parameter would be baked in as a constant).
        with eager_mode(), _reparametrize_module(self.original, state, tie_weights=True):
            result = self.original(*args, **kwargs)
        leaves, structure = flatten(result)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        for leaf in constants.values():
            if not isinstance(leaf, PLAIN_OUTPUT_TYPES):
                # It may hold tensors the graph cannot return (a cache object, say): returned as
                # a constant, they would be the trace's tensors, detached from the call.
                raise ExportError(
                    f"the forward returns a {type(leaf).__name__}, which is neither a tensor, a "
                    "plain value nor a pytree container (tuple, list, dict, dataclass, or a type "
                    "registered with torch.utils._pytree)"
                )
        self.template = OutputTemplate(structure, constants, positions)
        return _distinct_outputs([leaves[i] for i in positions], flat)


def _distinct_outputs(
    outputs: list[torch.Tensor], inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Clone outputs that are inputs or repeat another output, so each gets its own graph name."""
    seen = {id(t) for t in inputs}
    distinct = []
    for tensor in outputs:
        distinct.append(tensor.clone() if id(tensor) in seen else tensor)
        seen.add(id(tensor))
    return tuple(distinct)


def export_module(
    module: torch.nn.Module,
    forward: Callable,
    state: dict[str, torch.Tensor],
    call: FlatCall,
) -> ExportedGraph:
    """Trace `forward(module, *call)` with `state` as inputs; raise ExportError if impossible."""
    names = list(state)
    traced = _Traced(_Original(module, forward), names, call)
    # Buffers are cloned so a forward that updates them in place (BatchNorm running stats) does
    # not update them twice, and so the update can be detected below.
    state_for_trace = [t.detach() if isinstance(t, torch.nn.Parameter) else t.clone()
                       for t in state.values()]
    versions = [t._version for t in state_for_trace]
    inputs = [t.detach() for t in call.tensors]
    input_versions = [t._version for t in inputs]
    graph_input_names = [state_name(n) for n in names] + [
        input_name(i) for i in range(len(inputs))
    ]
    dynamic_axes = {input_name(i): list(range(t.dim())) for i, t in enumerate(inputs) if t.dim()}
    buffer = io.BytesIO()
    tracer_messages: list[str] = []
    try:
        with _export_lock, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.onnx.export(
                traced,
                tuple(state_for_trace + inputs),
                buffer,
                dynamo=False,
                input_names=graph_input_names,
                opset_version=OPSET,
                # PRESERVE: each submodule keeps its own train/eval flag (a frozen BatchNorm in
                # eval inside a training model stays so).
                training=torch.onnx.TrainingMode.PRESERVE,
                do_constant_folding=False,
                dynamic_axes=dynamic_axes,
                external_data=False,
            )
        tracer_messages = [
            str(w.message) for w in caught if issubclass(w.category, torch.jit.TracerWarning)
        ]
    except Exception as error:  # the exporter raises many types; all mean "cannot capture"
        raise ExportError(f"torch.onnx.export failed: {type(error).__name__}: {error}") from error
    _check_no_mutation(names, state_for_trace, versions, "module state")
    _check_no_mutation([f"argument {i}" for i in range(len(inputs))], inputs, input_versions,
                       "argument")
    value_dependent = [m for m in tracer_messages if _is_value_dependent(m)]
    if value_dependent:
        raise ExportError(
            "the forward branches on tensor values, which one traced graph cannot capture: "
            + value_dependent[0]
        )
    model = with_optional_outputs(decompose_cross_entropy(onnx.load_from_string(buffer.getvalue())))
    present = {value.name for value in model.graph.input}
    assert traced.template is not None
    return ExportedGraph(
        model=model,
        state_names=[n for n in names if state_name(n) in present],
        input_positions=[i for i in range(len(inputs)) if input_name(i) in present],
        graph_inputs=[value.name for value in model.graph.input],
        graph_outputs=[value.name for value in model.graph.output],
        outputs=traced.template,
        static_shapes=bool(tracer_messages),
    )


def _is_value_dependent(message: str) -> bool:
    return "Converting a tensor to a Python" in message


def _check_no_mutation(
    names: list[str], tensors: list[torch.Tensor], versions: list[int], what: str
) -> None:
    for name, tensor, version in zip(names, tensors, versions):
        if tensor._version != version:
            raise ExportError(
                f"the forward modifies {what} '{name}' in place (e.g. BatchNorm running "
                "statistics); an ONNX graph cannot carry that update back"
            )
