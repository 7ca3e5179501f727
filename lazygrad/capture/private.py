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
from collections.abc import Iterator

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

@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Inside: `torch.compiler.is_compiling()` is True, so models skip eager-only checks on
    values (transformers' attention-mask fast paths) as for torch.compile; and AOTAutograd's
    pass that turns Python-float size arithmetic into tensors is off (it is for dynamo's float
    inputs, and failed with a KeyError on BatchNorm's `n / (n - 1)` of symbolic sizes: the
    arithmetic stays size arithmetic, which the exporter translates)."""
    previous = torch.compiler._is_compiling_flag
    previous_tensorify = os.environ.get(_TENSORIFY)
    torch.compiler._is_compiling_flag = True
    os.environ[_TENSORIFY] = "0"
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous
        if previous_tensorify is None:
            os.environ.pop(_TENSORIFY, None)
        else:
            os.environ[_TENSORIFY] = previous_tensorify


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
    "get_decompositions",
    "onnx_constants",
    "onnx_core",
    "onnx_decomp",
    "onnx_fx_passes",
    "onnx_registration",
]

onnx_constants = _constants
onnx_core = _core
onnx_decomp = _decomp
onnx_fx_passes = _fx_passes
onnx_registration = _registration
