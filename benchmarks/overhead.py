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

import lazygrad
from lazygrad.api import runtime_of
from lazygrad.examples.models import ThreeHeadMLP
from lazygrad.session import GraphSession, _to_ortvalue


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
    """The forward session of the model's only graph pair, and its feeds for input `x`.

    The model has only run in eval mode under no_grad, so its one pair is the inference graph
    (mask None, no backward), built right after the first, eager, call. Its forward feeds are
    primals only (no random draws): module state in `named_parameters` then `named_buffers`
    order, then `x`, as the runtime lays them out.
    """
    (entry,) = runtime_of(model)._pairs.values()
    pair = entry.pair
    session = pair.session("forward", torch.device("cpu"))
    primals = [*model.parameters(), *model.buffers(), x]
    feeds = {
        name: primals[feed.index]
        for name, feed in zip(session.input_names, pair.graphs.forward_feeds, strict=True)
    }
    return session, feeds


def _per_call_us(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def _ort_run(session: GraphSession, feeds: dict[str, torch.Tensor]) -> Callable[[], object]:
    """ORT's own run of `session`'s graph on an IOBinding bound once: nothing of lazygrad's."""
    raw = session._session._sess
    binding = ort_c.SessionIOBinding(raw)
    for name, tensor in feeds.items():
        binding.bind_ortvalue_input(name, _to_ortvalue(tensor))
    for name in session.output_names:
        binding.bind_output(name, session.output_device)
    return lambda: raw.run_with_iobinding(binding, None)


def measure(blocks: int, calls: int = 200) -> Overhead:
    """Median over `blocks` interleaved blocks of `calls` calls of each way.

    Two calls before timing: the first runs in eager PyTorch and builds the inference graph,
    the second is ORT's first run of it.
    """
    torch.manual_seed(0)
    model = lazygrad.lazy(ThreeHeadMLP()).eval()
    x = torch.randn(6, 16)
    with torch.no_grad():
        model(x)
        model(x)
        session, feeds = _inference_session(model, x)
        ways: dict[str, Callable[[], object]] = {
            "lazygrad": lambda: model(x),
            "session": lambda: session.run(list(feeds.values())),
            "ort": _ort_run(session, feeds),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(blocks):
            for name, call in ways.items():
                times[name].append(_per_call_us(call, calls))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return Overhead(medians["lazygrad"], medians["session"], medians["ort"])
