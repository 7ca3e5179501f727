"""Running ONNX graphs on torch tensors: ORT sessions, zero-copy in and out through DLPack.

Inputs are handed to ORT as OrtValues that alias the torch storage, outputs come back as
OrtValues that torch adopts without a copy; the same IOBinding path serves CPU and CUDA.
The module's parameters are fed every call: their OrtValues are made once and reused while the
tensor's storage stays where it was (an optimizer updates it in place), which keeps the per-call
cost to the call's own inputs and outputs.
"""

from __future__ import annotations

import time

import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as ort_c
from torch._C import _from_dlpack
from torch.utils.dlpack import to_dlpack

from lazygrad import clock

# Measured: these fusions drop tensors that are requested graph outputs (the stash needs them):
# SkipLayerNormFusion loses LayerNormalization's Mean/InvStdDev, GatherToSliceFusion a Range.
DISABLED_OPTIMIZERS = ["SkipLayerNormFusion", "GatherToSliceFusion"]


class GraphRunError(RuntimeError):
    """ORT cannot load or run a graph on these inputs (no kernel for a dtype, a shape mismatch)."""


def cuda_provider_available() -> bool:
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


class GraphSession:
    """One ORT InferenceSession bound to one torch device."""

    def __init__(
        self,
        model: onnx.ModelProto,
        device: torch.device,
        persistent: frozenset[str] = frozenset(),
    ) -> None:
        """`persistent`: inputs fed the same long-lived tensor every call (module state)."""
        self.device = device
        self.input_names = [value.name for value in model.graph.input]
        self.output_names = [value.name for value in model.graph.output]
        self._persistent = persistent
        self._ortvalues: dict[str, tuple[torch.Tensor, tuple, ort_c.OrtValue]] = {}
        self._model_bytes = model.SerializeToString()
        self._session = self._create(onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL)
        self._output_device = _ort_device(device)

    def _create(self, level: onnxruntime.GraphOptimizationLevel) -> onnxruntime.InferenceSession:
        options = onnxruntime.SessionOptions()
        # Fatal only: ORT's warnings (unused initializers) are noise here, and its errors come
        # back as exceptions that the runtime explains; printed as well, they would mislead.
        options.log_severity_level = 4
        options.graph_optimization_level = level
        # Outputs and stashed tensors leave ORT and live in torch until backward; an arena would
        # keep their peak reserved for the whole process, and memory saved by a smaller stash
        # would never be given back.
        options.enable_cpu_mem_arena = False
        # ORT's intra-op threads spin after a run by default; torch's OpenMP threads, which run
        # the user's loss and optimizer right after, then wait on cores the spinners hold
        # (measured on 2 cores: an eager MoE step next to a lazy model 9 ms -> 58 ms).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = _providers(self.device)
        try:
            return onnxruntime.InferenceSession(
                self._model_bytes, options, providers=providers,
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
        except Exception as error:  # e.g. no kernel for an op at this dtype on this device
            raise GraphRunError(f"ORT cannot load the graph on {self.device}: {error}") from error

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run with `feeds` (name -> tensor on this session's device); outputs in graph order."""
        try:
            return _to_tensors(self._run(feeds))
        except _MissingOutput:
            # A fusion we have not met yet dropped a requested output: fall back, for good, to
            # the basic optimisation level, which does no fusions.
            self._session = self._create(onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC)
            try:
                return _to_tensors(self._run(feeds))
            except _MissingOutput as missing:
                name = self.output_names[missing.index]
                raise GraphRunError(f"ORT produced no tensor for output '{name}'") from None

    def _run(self, feeds: dict[str, torch.Tensor]) -> ort_c.OrtValueVector:
        binding = ort_c.SessionIOBinding(self._session._sess)
        for name in self.input_names:
            binding.bind_ortvalue_input(name, self._ortvalue(name, feeds[name]))
        for name in self.output_names:
            binding.bind_output(name, self._output_device)
        if self.device.type == "cuda":
            binding.synchronize_inputs()
        started = time.perf_counter()
        try:
            self._session._sess.run_with_iobinding(binding, None)
        except Exception as error:  # ORT's own exception types, re-raised with the graph named
            raise GraphRunError(str(error)) from error
        if self.device.type == "cuda":
            binding.synchronize_outputs()
        clock.add_ort(time.perf_counter() - started)
        return binding.get_outputs()

    def _ortvalue(self, name: str, tensor: torch.Tensor) -> ort_c.OrtValue:
        if name not in self._persistent:
            return _to_ortvalue(tensor)
        if not tensor.is_contiguous():
            return _to_ortvalue(tensor)  # a contiguous copy: it would not see later updates
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        cached = self._ortvalues.get(name)
        # Same tensor, same storage: the OrtValue still aliases it (in-place updates included).
        if cached is not None and cached[0] is tensor and cached[1] == key:
            return cached[2]
        value = _to_ortvalue(tensor)
        self._ortvalues[name] = (tensor, key, value)
        return value


def _providers(device: torch.device) -> list:
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda":
        if not cuda_provider_available():
            raise RuntimeError(
                "lazygrad: CUDA tensors were given but onnxruntime's CUDAExecutionProvider "
                "is not available in this installation"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(index).cuda_stream
        # ORT computes on torch's current stream, so no extra synchronisation is needed between
        # torch producing an input and ORT reading it, nor ORT writing and torch reading.
        options = {"device_id": str(index), "user_compute_stream": str(stream)}
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    raise RuntimeError(f"lazygrad: unsupported device {device}; expected cpu or cuda")


def _ort_device(device: torch.device) -> ort_c.OrtDevice:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return ort_c.OrtDevice(ort_c.OrtDevice.cuda(), ort_c.OrtDevice.default_memory(), index)
    return ort_c.OrtDevice(ort_c.OrtDevice.cpu(), ort_c.OrtDevice.default_memory(), 0)


class _MissingOutput(Exception):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def _to_tensors(values: ort_c.OrtValueVector) -> list[torch.Tensor]:
    try:
        tensors = values.to_dlpacks(_from_dlpack)
    except RuntimeError:  # an output without a value; find which (rare: not on the fast path)
        for index in range(len(values)):
            if not values[index].has_value():
                raise _MissingOutput(index) from None
        raise
    if _BOOL_AS_UINT8:
        for index in values.bool_tensor_indices():
            tensors[index] = tensors[index].view(torch.bool)  # DLPack carried it as uint8
    return tensors


def _bool_as_uint8() -> bool:
    """Before onnxruntime 1.32, DLPack carried bool as uint8 plus a flag, both ways."""
    try:
        ort_c.OrtValue.from_dlpack(to_dlpack(torch.zeros(1, dtype=torch.bool)))
    except TypeError:
        return True
    return False


_BOOL_AS_UINT8 = _bool_as_uint8()


def _to_ortvalue(tensor: torch.Tensor) -> ort_c.OrtValue:
    tensor = tensor.detach().contiguous()
    if not _BOOL_AS_UINT8:
        return ort_c.OrtValue.from_dlpack(to_dlpack(tensor))
    if tensor.dtype == torch.bool:
        return ort_c.OrtValue.from_dlpack(to_dlpack(tensor.view(torch.uint8)), True)
    return ort_c.OrtValue.from_dlpack(to_dlpack(tensor), False)
