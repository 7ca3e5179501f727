"""Per-call Python overhead of lazygrad's runtime over ONNX Runtime's own run, on a tiny model.

Ways to run the same inference graph of `ThreeHeadMLP`, interleaved in blocks:
- `lazygrad`: the lazy model called under `torch.no_grad()` (signature, cache lookup, feeds,
  session, output rebuild);
- `GraphSession.run`: lazygrad's session wrapper alone (IOBinding and DLPack in and out);
- `ORT run`: `run_with_iobinding` on an IOBinding bound once, i.e. ORT's own cost per call;
and, for the breakdown, two of the call's stages alone: the signature (`flatten_call`,
`ModuleState.read`, `LastSignature.of` on the model's own runtime objects) and the pair's run
(`GraphPair.forward`, `outputs` and the output template's rebuild). The graph is tiny, so what
is left above `ORT run` is the per-call cost a user pays on any model.

`python -m benchmarks.overhead` prints the figures; `--spinning` measures instead the steady
step of the BERT-shaped workload with ORT's intra-op threads spinning or not (and with one
intra-op thread), interleaved with eager PyTorch: the measurement behind `session.py`'s settings
(spinning within a run only; as many intra-op threads as torch's, two on this project's machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as ort_c

import lazygrad
from lazygrad.api import runtime_of
from lazygrad.examples.models import ThreeHeadMLP
from lazygrad.session import GraphSession, _to_ortvalue
from lazygrad.signature import flatten_call


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Median microseconds per call of each way to run the graph, and of two stages alone."""

    lazygrad_us: float
    session_us: float
    ort_us: float
    signature_us: float = 0.0  # flatten_call + ModuleState.read + LastSignature.of
    pair_us: float = 0.0  # GraphPair.forward + outputs + the template's rebuild
    ort_in_call_us: float = 0.0  # ORT's run_with_iobinding timed inside lazygrad calls

    @property
    def runtime_us(self) -> float:
        """What lazygrad adds over ORT's own run: the figure the issue's target is about."""
        return self.lazygrad_us - self.ort_us

    def breakdown(self) -> dict[str, float]:
        """`runtime_us` split into stages (they sum to it). Each stage is timed alone; the rest
        is what no stage alone shows, including the cost of running the stages together."""
        return {
            "signature (flatten, module state, signature)": self.signature_us,
            "session wrapper (IOBinding, DLPack in and out)": self.session_us - self.ort_us,
            "feeds and outputs (GraphPair, output template)": self.pair_us - self.session_us,
            "rest (module call, lookups, sizes, locks, stages together)": (
                self.lazygrad_us - self.signature_us - self.pair_us
            ),
        }


def _inference_session(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[GraphSession, list[torch.Tensor]]:
    """The forward session of the model's only graph pair, and its inputs for input `x`.

    The model has only run in eval mode under no_grad, so its one pair is the inference graph
    (mask None, no backward), built right after the first, eager, call. Its forward feeds are
    primals only (no random draws): module state in `named_parameters` then `named_buffers`
    order, then `x`, as the runtime lays them out.
    """
    (entry,) = runtime_of(model)._pairs.values()
    pair = entry.pair
    session = pair.session("forward", torch.device("cpu"))
    primals = [*model.parameters(), *model.buffers(), x]
    return session, [primals[feed.index] for feed in pair.graphs.forward_feeds]


def _per_call_us(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def _ort_run(session: GraphSession, inputs: list[torch.Tensor]) -> Callable[[], object]:
    """ORT's own run of `session`'s graph on an IOBinding bound once: nothing of lazygrad's
    (after the first run ORT writes into the outputs it allocated then)."""
    raw = session._session._sess
    binding = ort_c.SessionIOBinding(raw)
    for name, tensor in zip(session.input_names, inputs, strict=True):
        binding.bind_ortvalue_input(name, _to_ortvalue(tensor))
    for name in session.output_names:
        binding.bind_output(name, session.output_device)
    return lambda: raw.run_with_iobinding(binding, None)


def _stages(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The signature and the pair's run of a call, each alone, on the model's own objects."""
    runtime = runtime_of(model)
    (entry,) = runtime._pairs.values()
    pair, device = entry.pair, torch.device("cpu")
    (template,) = [e.template for e in runtime._entries.values()]
    state = runtime._state.read()[0]
    primals = [*state.values(), x]
    env = pair.sizes(primals)

    def signature() -> object:
        call = flatten_call((x,), {})
        state, modes = runtime._state.read()
        return runtime._signatures.of(call, state, modes)

    def run_pair() -> object:
        roots = pair.roots(pair.forward(primals, [], device), env)
        return template.rebuild(pair.module_outputs(roots, primals, env))

    return {"signature": signature, "pair": run_pair}


def measure(blocks: int, calls: int = 200) -> Overhead:
    """Median over `blocks` interleaved blocks of `calls` calls of each way.

    Two calls before timing: the first runs in eager PyTorch and builds the inference graph,
    the second is ORT's first run of it.
    """
    torch.manual_seed(0)
    model = lazygrad.lazy(ThreeHeadMLP(), wait_for_builds=True).eval()
    x = torch.randn(6, 16)
    with torch.no_grad():
        model(x)
        model(x)
        session, inputs = _inference_session(model, x)
        ways: dict[str, Callable[[], object]] = {
            "lazygrad": lambda: model(x),
            "session": lambda: session.run(inputs),
            "ort": _ort_run(session, inputs),
            **_stages(model, x),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(blocks):
            for name, call in ways.items():
                times[name].append(_per_call_us(call, calls))
        in_call = _ort_in_call(session, lambda: model(x), blocks * calls)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return Overhead(
        medians["lazygrad"], medians["session"], medians["ort"], medians["signature"],
        medians["pair"], in_call,
    )


def _ort_in_call(session: GraphSession, call: Callable[[], object], calls: int) -> float:
    """Median microseconds of ORT's own run inside `calls` calls (after the timed blocks: the
    timer wraps this thread's binding's run): ORT runs slower there than alone, its caches
    cooled by the rest of the call, which `runtime_us` counts as lazygrad's."""
    binding = session._binding()
    run, spans = binding._run, []

    def timed(*args: object) -> None:
        start = time.perf_counter_ns()
        run(*args)
        spans.append(time.perf_counter_ns() - start)

    binding._run = timed
    try:
        for _ in range(calls):
            call()
    finally:
        binding._run = run
    return statistics.median(spans) / 1e3


# ---- thread settings: ORT's intra-op threads spinning or not, on the BERT-shaped workload ----

SETTINGS = {  # name -> (allow_spinning, intra_op_num_threads; None: torch's thread count)
    "spinning within runs only (lazygrad's setting)": ("within runs", None),
    "no spinning": ("off", None),
    "spinning (ORT's default)": ("always", None),
    "no spinning, 1 intra-op thread": ("off", 1),
}


def _recreate_sessions(model: torch.nn.Module, spinning: str, threads: int | None) -> None:
    """Every session of the model made again with these thread settings (the rest as
    `GraphSession` makes them)."""
    for entry in runtime_of(model)._pairs.values():
        for session in entry.pair._sessions.values():
            level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
            session._session = session._create(level, spinning=spinning, threads=threads)


def spinning(rounds: int, composition: str = "loss") -> dict[str, tuple[float, float]]:
    """Steady training step of the BERT-shaped workload (forward, loss, backward, AdamW step)
    per thread setting: (median ms, median of the per-round ratios to eager's step)."""
    from benchmarks.workloads import bert

    workload = bert(composition)

    def runner(model: torch.nn.Module) -> Callable[[int], None]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = workload.step(model)

        def run(index: int) -> None:
            step(index)
            optimizer.step()

        return run

    runs: dict[str, Callable[[int], None]] = {"eager": runner(workload.model())}
    for name, (spin, threads) in SETTINGS.items():
        model = lazygrad.lazy(workload.model(), wait_for_builds=True)
        runs[name] = runner(model)
        for index in range(workload.settle):
            runs[name](index)
        _recreate_sessions(model, spin, threads)
    for run in runs.values():
        run(0)  # ORT's first run of the new sessions; eager's warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(index)
            times[name].append(time.perf_counter() - start)
    return {
        name: (
            statistics.median(values) * 1e3,
            statistics.median(a / b for a, b in zip(values, times["eager"])),
        )
        for name, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=31, help="interleaved blocks per way")
    parser.add_argument("--spinning", action="store_true", help="the thread-settings study")
    parser.add_argument("--rounds", type=int, default=12, help="steps per setting (--spinning)")
    args = parser.parse_args()
    if args.spinning:
        print(f"BERT-shaped 'loss' step + AdamW, {args.rounds} interleaved rounds, medians:")
        for name, (ms, ratio) in spinning(args.rounds).items():
            print(f"  {name:36s} {ms:8.1f} ms  {ratio:5.2f}x eager")
        return
    cost = measure(args.blocks)
    print(f"ThreeHeadMLP, 6x16, eval + no_grad, {args.blocks} interleaved blocks of 200 calls, "
          "medians (us per call):")
    print(f"  lazygrad call {cost.lazygrad_us:7.1f}   GraphSession.run {cost.session_us:7.1f}   "
          f"ORT run {cost.ort_us:7.1f}")
    print(f"  overhead over ORT's own run: {cost.runtime_us:.1f} us")
    for stage, us in cost.breakdown().items():
        print(f"    {stage:60s} {us:7.1f}")
    print(f"  ORT's run timed inside lazygrad calls: {cost.ort_in_call_us:.1f} us (overhead over "
          f"it: {cost.lazygrad_us - cost.ort_in_call_us:.1f} us)")


if __name__ == "__main__":
    main()
