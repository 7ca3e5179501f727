"""Per-call Python overhead of lazygrad's runtime over ONNX Runtime's own run, on a tiny model.

Three ways to run the same inference graph of `ThreeHeadMLP`, interleaved in blocks:
- `lazygrad`: the lazy model called under `torch.no_grad()` (signature, cache lookup, feeds,
  session, output rebuild);
- `GraphSession.run`: lazygrad's session wrapper alone (IOBinding and DLPack in and out);
- `ORT run`: `run_with_iobinding` on an IOBinding bound once, i.e. ORT's own cost per call.
The graph is tiny, so what is left above `ORT run` is the per-call cost a user pays on any model.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from onnxruntime.capi import _pybind_state as ort_c
from torch.utils.dlpack import to_dlpack

import lazygrad
from lazygrad.api import runtime_of
from lazygrad.examples.models import ThreeHeadMLP
from lazygrad.session import GraphSession


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Median microseconds per call of each way to run the graph."""

    lazygrad_us: float
    session_us: float
    ort_us: float

    @property
    def runtime_us(self) -> float:
        """What lazygrad adds over ORT's own run: the figure the issue's target is about."""
        return self.lazygrad_us - self.ort_us


def _inference_session(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[GraphSession, dict[str, torch.Tensor]]:
    """The session lazygrad made for the model's only signature, and its feeds for input `x`.

    The model has only run in eval mode under no_grad, so that session is the inference graph and
    is the only one.
    """
    (entry,) = runtime_of(model)._signatures.values()
    (session,) = entry.sessions.values()
    state = dict(model.named_parameters())
    tensors = [state[name] for name in entry.exported.state_names] + [x]
    return session, dict(zip(entry.exported.graph_inputs, tensors))


def _per_call_us(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def measure(blocks: int, calls: int = 200) -> Overhead:
    """Median over `blocks` interleaved blocks of `calls` calls of each way."""
    torch.manual_seed(0)
    model = lazygrad.lazy(ThreeHeadMLP()).eval()
    x = torch.randn(6, 16)
    with torch.no_grad():
        model(x)
        session, feeds = _inference_session(model, x)
        raw = session._session._sess
        binding = ort_c.SessionIOBinding(raw)
        for name, tensor in feeds.items():
            binding.bind_ortvalue_input(name, ort_c.OrtValue.from_dlpack(to_dlpack(tensor), False))
        for name in session.output_names:
            binding.bind_output(name, session._output_device)
        ways: dict[str, Callable[[], object]] = {
            "lazygrad": lambda: model(x),
            "session": lambda: session.run(feeds),
            "ort": lambda: raw.run_with_iobinding(binding, None),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(blocks):
            for name, call in ways.items():
                times[name].append(_per_call_us(call, calls))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return Overhead(medians["lazygrad"], medians["session"], medians["ort"])

