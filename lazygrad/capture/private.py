"""Every private PyTorch API lazygrad uses, in one place.

AOTAutograd's tracer and partitioner, fake tensors with symbolic sizes, and the ONNX exporter's
translator are the only ways to capture a joint forward/backward graph with PyTorch's own
derivative formulas and to translate it without a second trace. They are private, so the
supported torch and onnxscript versions are pinned in `pyproject.toml`, and the exactness tests
gate any upgrade. Nothing else in lazygrad imports a private torch module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

import torch
from torch._decomp import get_decompositions
from torch._dispatch.python import enable_python_dispatcher
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import default_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import traceback as fx_traceback
from torch.fx.experimental import _config as fx_config
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
    free_unbacked_symbols,
)
from torch.onnx._internal.exporter import _constants, _core, _decomp, _fx_passes, _registration
from torch.utils._sympy.printers import PythonPrinter

# The exporter and the symbolic-shape machinery log every specialisation and skipped torchvision
# op at WARNING; for a runtime that traces on the user's behalf that is noise.
for _name in (
    "torch.onnx",
    "torch._dynamo",
    "torch.fx.experimental.symbolic_shapes",
    "torch._functorch",
    "torch.onnx._internal.exporter._registration",
):
    logging.getLogger(_name).setLevel(logging.ERROR)

_tracing = threading.local()


def _is_compiling_on_this_thread() -> bool:
    return getattr(_tracing, "active", False) or _is_compiling()


_is_compiling = torch.compiler.is_compiling


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


def queue_at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` when the backward running now ends (autograd engine's own queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


_TENSORIFY = "TENSORIFY_PYTHON_SCALARS"  # read by torch._dynamo.utils._is_tensorify_enabled


__all__ = [
    "compiling",
    "DimDynamic",
    "ExportGraphSignature",
    "ExportedProgram",
    "FakeTensorMode",
    "GuardOnDataDependentSymNode",
    "InputKind",
    "InputSpec",
    "ModuleCallEntry",
    "ModuleCallSignature",
    "OutputKind",
    "OutputSpec",
    "PythonPrinter",
    "ShapeEnv",
    "StatelessSymbolicContext",
    "TensorArgument",
    "aot_function",
    "default_partition",
    "enable_python_dispatcher",
    "free_unbacked_symbols",
    "fx_config",
    "fx_traceback",
    "get_decompositions",
    "onnx_constants",
    "onnx_core",
    "onnx_decomp",
    "onnx_fx_passes",
    "onnx_registration",
    "queue_at_backward_end",
]

onnx_constants = _constants
onnx_core = _core
onnx_decomp = _decomp
onnx_fx_passes = _fx_passes
onnx_registration = _registration


def release_saved_tensors(ctx: object) -> None:
    """Drop a custom autograd Function's references to its saved tensors during its backward,
    once they were unpacked (`ctx.saved_tensors`, with PyTorch's version check): the backward
    then frees each as soon as it is done with it, as eager's nodes do. Not when the graph is
    retained (`retain_graph=True`): a later backward unpacks them again. Registering hooks on
    a saved tensor packs it (here: into nothing) and drops the node's own reference."""
    if torch._C._autograd._get_current_graph_task_keep_graph():
        return
    for saved in ctx._raw_saved_tensors:  # type: ignore[attr-defined]
        saved.register_hooks(_dropped, _dropped)


def _dropped(_: object) -> None:
    return None
