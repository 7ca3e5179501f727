"""Running ONNX graphs on torch tensors: ORT sessions, zero-copy in and out through DLPack.

Inputs are handed to ORT as OrtValues that alias the torch storage, outputs come back as
OrtValues that torch adopts without a copy; the same IOBinding path serves CPU and CUDA.
Each thread reuses one IOBinding per session. The module's parameters are fed every call: their
OrtValues are made and bound once and stay bound while the tensor's storage stays where it was
(an optimizer updates it in place), which keeps the per-call cost to the call's own inputs and
outputs. A stacked parameter's slices that the graph reads (an MoE layer's experts) are bound
as inputs of their own, each over the parameter's memory, and a stacked gradient's blocks as
outputs over the slices of one tensor made for the call (`capture/stacked_io.py`): ORT copies
neither.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as ort_c
from torch._C import _from_dlpack
from torch.utils.dlpack import to_dlpack

from lazygrad import clock, openmp
from lazygrad.capture import stacked_io

# The model's metadata key listing, comma-separated, the outputs that are complex tensors in
# ONNX's real representation (a trailing dimension of 2: real, imaginary), as the exporter
# writes them (`capture/to_onnx.py`); torch views them as complex again without a copy.
COMPLEX_OUTPUTS = "lazygrad.complex_outputs"

# Measured: these fusions drop tensors that are requested graph outputs (the stash needs them):
# SkipLayerNormFusion loses LayerNormalization's Mean/InvStdDev, GatherToSliceFusion a Range.
DISABLED_OPTIMIZERS = ["SkipLayerNormFusion", "GatherToSliceFusion"]

# The largest result ORT's constant folding may make (bytes). Without a cap it folds a gradient's
# zeros (`ConstantOfShape` of a static shape: the embedding gradient's [vocabulary, hidden],
# before the scatter-add of its rows) into an initializer the session keeps for good, which
# each run copies anyway. Measured on workload A's backward (benchmarks/memory_targets.py): the
# session of its second segment took 38 MiB on creation, 8 MiB with this cap. Shape arithmetic
# and small masks, well under it, are still folded.
FOLDED_AT_MOST = 1 << 20

# When ORT's intra-op threads spin waiting for work: "within runs" (between a run's kernels,
# stopping when the run returns), "always" (ORT's default: after a run too) or "off". Why
# "within runs": `_create`.
SPINNING = "within runs"


class GraphRunError(RuntimeError):
    """ORT cannot load or run a graph on these inputs (no kernel for a dtype, a shape mismatch)."""


# ORT's error from a node: "... while running GatherElements node. Name:'node_gather' Status
# Message: /onnxruntime_src/.../gather_elements.cc:150 void onnxruntime::core_impl(const
# Tensor*, ...) [with Tin = long int] GatherElements op: Out of range value in index tensor".
_NODE_ERROR = re.compile(
    r"running (?P<op>\w+) node\. Name:'(?P<name>[^']*)' Status Message: (?P<message>.*)", re.S)
_SOURCE_LINE = re.compile(r"\S+:\d+ ")
_CPP_SIGNATURE = re.compile(r"[^()]*\(.*?\)(?: const)?(?: \[with [^\]]*\])? ")


def ort_message(error: Exception) -> str:
    """ORT's error as a user reads it in a warning or a reason: the node that failed and what
    it said, without the C++ source line and function signature that ORT puts before it."""
    text = str(error).strip()
    found = _NODE_ERROR.search(text)
    if found is None:
        return text
    message = found["message"].strip()
    located = _SOURCE_LINE.match(message)
    if located:
        message = _CPP_SIGNATURE.sub("", message[located.end():], count=1)
    return f"ORT's {found['op']} node '{found['name']}' failed: {message}"


def cuda_provider_available() -> bool:
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


class GraphSession:
    """One ORT InferenceSession bound to one torch device."""

    def __init__(
        self,
        model: onnx.ModelProto,
        device: torch.device,
        persistent: frozenset[str] = frozenset(),
        arena: bool = False,
        in_node_order: bool = False,
    ) -> None:
        """`persistent`: inputs fed the same long-lived tensor every call (module state), whose
        shape and dtype stay as they are for the session's life (a pair's sessions serve one
        signature, which holds them); a new storage or layout is seen. `arena`: ORT takes its
        memory from one CPU arena for the process, which keeps it between runs (default: from
        the C allocator torch uses too; `benchmarks/steady.py --ablate` measures the arena).
        `in_node_order`: ORT runs ready nodes in the graph's node order (capture/node_order.py),
        not in its default depth-first order back from the outputs."""
        self.device = device
        self.arena = arena
        self.in_node_order = in_node_order
        self.input_names = [value.name for value in model.graph.input]
        self.output_names = [value.name for value in model.graph.output]
        complex_names = {
            name for entry in model.metadata_props if entry.key == COMPLEX_OUTPUTS
            for name in entry.value.split(",")
        }
        self.complex_at = [i for i, name in enumerate(self.output_names) if name in complex_names]
        self.state_at = [i for i, name in enumerate(self.input_names) if name in persistent]
        self.call_at = [i for i, name in enumerate(self.input_names) if name not in persistent]
        # Stacked parameters fed, and stacked gradients returned, as their slices too (uncopied).
        model, stacked_inputs, self.stacked_outputs = stacked_io.sliced(model, persistent)
        self.state_slices = {entry.name: entry.slices for entry in stacked_inputs}
        self._model_bytes = model.SerializeToString()
        self._session = self._create(onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL)
        self.output_device = _ort_device(device)
        # Bound in place of a call's own inputs between calls: a binding must not keep them alive.
        self.placeholder = _to_ortvalue(torch.zeros(1, device=device))
        self._bindings = threading.local()

    def _create(
        self,
        level: onnxruntime.GraphOptimizationLevel,
        spinning: str | None = None,
        threads: int | None = None,
    ) -> onnxruntime.InferenceSession:
        """`spinning` (None: `SPINNING`), `threads` (None: torch's intra-op thread count): the
        thread settings that `benchmarks/overhead.py --spinning` compares; lazygrad uses the
        defaults."""
        options = onnxruntime.SessionOptions()
        # Fatal only: ORT's warnings (unused initializers) are noise here, and its errors come
        # back as exceptions that the runtime explains; printed as well, they would mislead.
        options.log_severity_level = 4
        options.graph_optimization_level = level
        options.add_session_config_entry(
            "optimization.constant_folding_max_output_size_in_bytes", str(FOLDED_AT_MOST))
        if self.in_node_order:
            options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
        # No arena by default: ORT then allocates with the C allocator torch uses, so the two
        # reuse each other's freed memory as eager's ops do, and ORT keeps none between runs.
        # An arena is a second pool that keeps its peak for good, and ORT's (even shared by all
        # sessions, grown by what is asked) fragments when shapes and masks change. Measured on
        # 2026-12-04, warm disk cache, whole-process peak without -> with it: one shape and one
        # mask (benchmarks.memory_targets, A and B, keep and del) the same within 5 MiB; but the
        # BERT-shaped model of benchmarks/workloads.py trained with its three compositions in
        # turn and then over sequence lengths 64..256 in one process, 869 -> 1032 MiB after the
        # compositions and 992 -> 1902-1906 MiB after the lengths (1712 with the memory pattern
        # off too). The price of going without, in the same rounds (benchmarks.steady --ablate,
        # 2026-12-04 18:55): BERT `loss` / all three 0.899x / 0.843x eager against 0.793x /
        # 0.757x with the arena, MoE 0.912x against 0.882x; the 8-layer model of workload B,
        # 13-18% slower: without an arena glibc gives large freed blocks back to the system,
        # and a step faults 90-140 thousand pages in again. `arena=True` (Options) takes that
        # side of the trade. Without a CPU arena ORT's memory pattern is off too: it would ask
        # the system for one block of all a run's intermediates each run, whose pages all
        # fault (CUDA memory comes from the CUDA provider's own arena either way).
        options.enable_cpu_mem_arena = self.arena
        options.enable_mem_pattern = self.arena or self.device.type == "cuda"
        if self.arena and self.device.type == "cpu":
            _register_shared_cpu_arena()
            options.add_session_config_entry("session.use_env_allocators", "1")
        # ORT's intra-op threads spin between a run's kernels (a kernel's work reaches them
        # without a wake-up) and stop when the run returns. ORT's default keeps them spinning
        # after it too, and torch's OpenMP threads, which run the user's loss and optimizer
        # right after, then wait on cores the spinners hold (on 2 cores: an eager MoE step next
        # to a lazy model 9 ms -> 58 ms; the BERT-shaped step with AdamW 1.30-1.51x eager's
        # against 1.09-1.15x within runs only and 1.16-1.22x never spinning, 2026-12-06:
        # benchmarks/results/overhead.md).
        spinning = SPINNING if spinning is None else spinning
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", str(int(spinning != "off")))
        options.add_session_config_entry(
            "session.force_spinning_stop", str(int(spinning == "within runs")))
        # ORT and torch take turns on the same cores, so ORT uses as many threads as torch
        # does, and `torch.set_num_threads` sets both (the same two threads as ORT's default
        # here; one thread made that step 1.51x slower, faster only while others loaded the
        # machine).
        options.intra_op_num_threads = torch.get_num_threads() if threads is None else threads
        providers = _providers(self.device)
        try:
            return onnxruntime.InferenceSession(
                self._model_bytes, options, providers=providers,
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
        except Exception as error:  # e.g. no kernel for an op at this dtype on this device
            missing = re.search(r"Could not find an implementation for (\w+)\(", str(error))
            why = (f" (ONNX Runtime's {self.device.type.upper()} provider has no {missing[1]} "
                   "kernel for this graph's dtypes)" if missing else "")
            raise GraphRunError(
                f"ORT cannot load the graph on {self.device}: {error}{why}") from error

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on `inputs` (in graph input order, on this session's device); outputs in graph
        order."""
        try:
            return self._binding().run(inputs)
        except _MissingOutput:
            # A fusion we have not met yet dropped a requested output: fall back, for good, to
            # the basic optimisation level, which does no fusions.
            self._session = self._create(onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC)
            try:
                return self._binding().run(inputs)
            except _MissingOutput as missing:
                name = self._binding().bound_outputs[missing.index]
                raise GraphRunError(f"ORT produced no tensor for output '{name}'") from None

    def release_this_threads_binding(self) -> None:
        """Drop this thread's binding: it holds the module state it was last run on."""
        self._bindings.current = None

    def _binding(self) -> _Binding:
        """This thread's binding (an IOBinding is not safe to share between threads)."""
        binding = getattr(self._bindings, "current", None)
        if binding is None or binding.session is not self._session:
            binding = self._bindings.current = _Binding(self, self._session)
        return binding


class _Binding:
    """One thread's IOBinding of a session, reused call after call.

    Module state stays bound between calls: its OrtValue aliases the parameter's storage, so an
    optimizer's in-place update needs nothing, and it is made and bound again only when the
    tensor's storage moved (`p.data = ...`) or it is no longer contiguous. A call's own inputs and
    the outputs are bound for the call and released after it (the inputs by binding a
    placeholder, or by clearing every input where the call's own inputs are the most): the
    binding keeps no tensor of a call alive, so a backward's saved activations are freed when
    its run ends.
    """

    def __init__(self, owner: GraphSession, session: onnxruntime.InferenceSession) -> None:
        self.session = session
        self._run = session._sess.run_with_iobinding
        self._io = ort_c.SessionIOBinding(session._sess)
        self._names = owner.input_names
        self._slices = [owner.state_slices.get(owner.input_names[position], ())
                        for position in owner.state_at]
        self._state_at = owner.state_at
        self._call_at = owner.call_at
        stacked = {entry.name: entry for entry in owner.stacked_outputs}
        self._outputs = [name for name in owner.output_names if name not in stacked]
        # (position among the outputs, its slices, dtype) per output returned as slices
        self._stacked = [
            (owner.output_names.index(entry.name), entry, stacked_io.TORCH_DTYPES[entry.elem_type])
            for entry in owner.stacked_outputs
        ]
        self._device = owner.device
        # The output names as ORT returns their values: in the order bound
        self.bound_outputs = [*self._outputs, *(
            block for _, entry, _ in self._stacked for _, block in entry.slices)]
        self._complex_at = owner.complex_at
        self._output_device = owner.output_device
        self._placeholder = owner.placeholder
        self._cuda = owner.device.type == "cuda"
        self._clear_all = len(self._call_at) > len(self._state_at)
        # per state input: ((data_ptr, shape, dtype), its OrtValues by input name) of the tensor
        # last bound
        self._state: list[tuple[tuple, list] | None] = [None] * len(self._state_at)
        self._pointers: list[int] = []
        self._state_bound = False

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        io, names = self._io, self._names
        try:
            self._bind_state(inputs)
            for position in self._call_at:
                io.bind_ortvalue_input(names[position], _to_ortvalue(inputs[position]))
            for name in self._outputs:
                io.bind_output(name, self._output_device)
            stacks = self._bind_stacked_outputs()
            if self._cuda:
                io.synchronize_inputs()
            else:
                openmp.end_spinning_threads()  # they would share ORT's cores (openmp.py)
            started = time.perf_counter()
            try:
                self._run(io, None)
            except Exception as error:  # ORT's own exception types, re-raised with the graph named
                raise GraphRunError(ort_message(error)) from error
            if self._cuda:
                io.synchronize_outputs()
            clock.add_ort(time.perf_counter() - started)
            # Adopted by torch before the release: `get_outputs` is a view of the binding's own.
            outputs = _to_tensors(io.get_outputs())[:len(self._outputs)]
            for (position, _, _), stack in zip(self._stacked, stacks):
                outputs.insert(position, stack)
            for position in self._complex_at:
                outputs[position] = torch.view_as_complex(outputs[position])
            return outputs
        finally:
            self._release()

    def _bind_state(self, inputs: Sequence[torch.Tensor]) -> None:
        tensors = list(map(inputs.__getitem__, self._state_at))
        # Same storage, still contiguous: the OrtValues bound still alias the tensors (their
        # shapes and dtypes are the session's contract). Checked in two C-level passes: this
        # runs every call, for every parameter.
        pointers = list(map(torch.Tensor.data_ptr, tensors))
        io, names, state = self._io, self._names, self._state
        if pointers == self._pointers and all(map(torch.Tensor.is_contiguous, tensors)):
            if not self._state_bound:  # cleared after the last run: bind the same values again
                for entry in state:
                    for name, value in entry[1]:  # type: ignore[index]
                        io.bind_ortvalue_input(name, value)
                self._state_bound = True
            return
        for slot, position in enumerate(self._state_at):
            tensor = tensors[slot]
            if not tensor.is_contiguous():
                # A contiguous copy, made every call: it would not see later in-place updates.
                state[slot] = None
                pointers[slot] = -1  # no tensor's: the next call binds this slot again
                values = self._state_values(names[position], tensor.contiguous(), slot)
            else:
                key = (pointers[slot], tensor.shape, tensor.dtype)
                if state[slot] is None or state[slot][0] != key:
                    state[slot] = (key, self._state_values(names[position], tensor, slot))
                values = state[slot][1]
            for name, value in values:
                io.bind_ortvalue_input(name, value)
        self._pointers = pointers
        self._state_bound = True

    def _state_values(self, name: str, tensor: torch.Tensor, slot: int) -> list:
        """(input name, OrtValue) for a contiguous state tensor and the slices it is fed as
        too, each over the tensor's own memory."""
        return [(name, _to_ortvalue(tensor)),
                *((sliced, _to_ortvalue(tensor[index])) for index, sliced in self._slices[slot])]

    def _bind_stacked_outputs(self) -> list[torch.Tensor]:
        """One tensor per stacked output, its slices bound as the outputs of their blocks: ORT
        writes each block in place."""
        stacks = []
        for _, entry, dtype in self._stacked:
            stack = torch.empty(entry.shape, dtype=dtype, device=self._device)
            for index, block in entry.slices:
                self._io.bind_ortvalue_output(block, _to_ortvalue(stack[index]))
            stacks.append(stack)
        return stacks

    def _release(self) -> None:
        io = self._io
        io.clear_binding_outputs()  # the outputs now belong to torch alone
        if self._clear_all:
            io.clear_binding_inputs()
            self._state_bound = False
            return
        for position in self._call_at:
            io.bind_ortvalue_input(self._names[position], self._placeholder)


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
        options = {"device_id": str(index), "user_compute_stream": str(stream),
                   "use_tf32": tf32_option()}
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    raise RuntimeError(f"lazygrad: unsupported device {device}; expected cpu or cuda")


def tf32_option() -> str:
    """The CUDA provider's `use_tf32`, as torch computes float32 matmuls now. ORT's CUDA
    provider multiplies float32 matrices (and runs cuDNN convolutions) in TF32 by default on
    Ampere and later GPUs, 10 bits of mantissa, where torch's float32 matmuls are IEEE unless
    the user allows TF32 (`torch.backends.cuda.matmul.allow_tf32`,
    `torch.set_float32_matmul_precision("high")`): a gradient through ORT would be off by
    about 1e-3 of eager's. Read when a session is made."""
    return "1" if torch.backends.cuda.matmul.allow_tf32 else "0"


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
    tensor = tensor.detach()
    if tensor.is_complex():  # ONNX's real representation, as the exporter declares the input
        tensor = torch.view_as_real(tensor.resolve_conj())
    tensor = tensor.contiguous()
    if not _BOOL_AS_UINT8:
        return ort_c.OrtValue.from_dlpack(to_dlpack(tensor))
    if tensor.dtype == torch.bool:
        return ort_c.OrtValue.from_dlpack(to_dlpack(tensor.view(torch.uint8)), True)
    return ort_c.OrtValue.from_dlpack(to_dlpack(tensor), False)


_arena_lock = threading.Lock()
_arena_registered = False


def _register_shared_cpu_arena() -> None:
    """One CPU arena for every session of the process, grown by what is asked
    (kSameAsRequested), not by powers of two: sessions run one at a time on a thread, so a
    model's forward and backward segments, and other models' graphs, reuse the same memory
    instead of each keeping its own peak."""
    global _arena_registered
    with _arena_lock:
        if _arena_registered:
            return
        info = onnxruntime.OrtMemoryInfo(
            "Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
            onnxruntime.OrtMemType.DEFAULT,
        )
        onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, 1, -1, -1))
        _arena_registered = True
