"""`python -m benchmarks.profile [WORKLOAD] [--steps N] [--graphs DIR]`: where a steady step goes.

The same steady steps profiled twice, by each system's own profiler: ONNX Runtime's
(`SessionOptions.enable_profiling`, per-node kernel times of the forward and backward sessions)
for lazygrad, `torch.profiler` (self time per ATen op) for eager PyTorch, on the same model,
weights and inputs. The ops are grouped in families (GEMMs, softmax, layernorm, ...) and each
family is shown as ms per step and as a share of the step's kernel time: on a shared machine
absolute times drift with the load, shares do not. `--graphs DIR` also writes the graphs ORT
runs after its own optimisations (`SessionOptions.optimized_model_filepath`), to see which
fusions happened.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnxruntime
import torch

import lazygrad
from benchmarks.workloads import WORKLOADS, Workload

# Op family of each ORT op type and ATen op; anything else is "other".
FAMILIES = {
    "gemm": {
        "MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger",
        "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
    },
    "softmax": {
        "Softmax", "LogSoftmax", "aten::_softmax", "aten::_log_softmax",
        "aten::_softmax_backward_data", "aten::_log_softmax_backward_data",
    },
    "loss": {"aten::nll_loss_forward", "aten::nll_loss_backward", "NegativeLogLikelihoodLoss"},
    "layernorm": {
        "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
        "aten::native_layer_norm", "aten::native_layer_norm_backward",
    },
    "gelu": {"Gelu", "BiasGelu", "FastGelu", "Erf", "aten::gelu", "aten::gelu_backward"},
    "layout": {
        "Transpose", "Reshape", "Expand", "Concat", "Slice", "Squeeze", "Unsqueeze", "Identity",
        "Split", "Shape", "Cast", "Tile", "Pad",
        "aten::copy_", "aten::clone", "aten::contiguous", "aten::transpose", "aten::t",
        "aten::view", "aten::reshape", "aten::permute", "aten::expand", "aten::_unsafe_view",
        "aten::as_strided", "aten::empty", "aten::empty_like", "aten::zeros", "aten::zeros_like",
        "aten::fill_", "aten::zero_", "aten::select", "aten::slice", "aten::unbind",
        "aten::stack", "aten::cat", "aten::unsqueeze", "aten::squeeze", "aten::new_zeros",
        "aten::detach", "aten::_to_copy", "aten::to", "aten::empty_strided", "aten::resize_",
    },
    "reduction": {
        "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceLogSumExp", "ArgMax", "TopK",
        "aten::sum", "aten::mean", "aten::max", "aten::amax", "aten::topk", "aten::logsumexp",
    },
    "gather/scatter": {
        "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements", "OneHot",
        "aten::embedding", "aten::embedding_dense_backward", "aten::index_select",
        "aten::index_add_", "aten::index_put_", "aten::_index_put_impl_", "aten::gather",
        "aten::scatter", "aten::scatter_add_", "aten::embedding_backward", "aten::one_hot",
    },
}
FAMILY_OF = {op: family for family, ops in FAMILIES.items() for op in ops}
ELEMENTWISE = "elementwise"  # the rest of ORT's op types and ATen ops: Add, Mul, Where, ...


def family(op: str) -> str:
    return FAMILY_OF.get(op, ELEMENTWISE)


@contextlib.contextmanager
def ort_profiling(folder: Path, graphs: Path | None) -> Iterator[list]:
    """Sessions created inside the block profile their runs into `folder` (and write their
    optimised graph into `graphs`); yields the list of those sessions."""
    sessions: list = []
    make_options, make_session = onnxruntime.SessionOptions, onnxruntime.InferenceSession

    def options() -> onnxruntime.SessionOptions:
        made = make_options()
        made.enable_profiling = True
        made.profile_file_prefix = str(folder / f"ort{len(sessions)}")
        if graphs is not None:
            made.optimized_model_filepath = str(graphs / f"optimized{len(sessions)}.onnx")
        return made

    def session(*args, **kwargs) -> onnxruntime.InferenceSession:
        made = make_session(*args, **kwargs)
        sessions.append(made)
        return made

    onnxruntime.SessionOptions, onnxruntime.InferenceSession = options, session
    try:
        yield sessions
    finally:
        onnxruntime.SessionOptions, onnxruntime.InferenceSession = make_options, make_session


def ort_kernel_times(trace: str, skip_runs: int) -> collections.Counter:
    """Microseconds per (ORT op type, node name, output shapes) over the runs of one profile
    after the first `skip_runs`."""
    events = json.loads(Path(trace).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    kept = runs[skip_runs:]
    totals: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if any(start <= event["ts"] <= end for start, end in kept):
            shapes = [list(value.values())[0] for value in event["args"]["output_type_shape"]]
            totals[event["args"]["op_name"], event["name"][: -len("_kernel_time")],
                   str(shapes)] += event["dur"]
    return totals


def lazy_profile(workload: Workload, steps: int, graphs: Path | None) -> collections.Counter:
    """Per (ORT op type, node, shapes): microseconds per steady step of the lazy model (forward
    and backward sessions)."""
    model = lazygrad.lazy(workload.model())
    step = workload.step(model)
    for index in range(workload.settle):
        step(index)
    lazygrad.wait_for_builds(model)
    runtime = lazygrad.api.runtime_of(model)
    with tempfile.TemporaryDirectory() as folder, ort_profiling(Path(folder), graphs) as made:
        for entry in list(runtime._pairs.values()):
            entry.pair._sessions.clear()  # new sessions, made with profiling on
        for index in range(workload.settle, workload.settle + steps + 1):
            step(index)
        totals: collections.Counter = collections.Counter()
        for session in made:
            totals.update(ort_kernel_times(session.end_profiling(), skip_runs=1))
    return collections.Counter({op: us / steps for op, us in totals.items()})


def eager_profile(workload: Workload, steps: int) -> collections.Counter:
    """Per ATen op: self microseconds per step of the eager model."""
    model = workload.model()
    step = workload.step(model)
    for index in range(workload.settle):
        step(index)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profiler:
        for index in range(workload.settle, workload.settle + steps):
            step(index)
    totals: collections.Counter = collections.Counter()
    for event in profiler.key_averages():
        if event.key.startswith("aten::"):
            totals[event.key] += event.self_cpu_time_total / steps
    return totals


def by_op(times: collections.Counter) -> collections.Counter:
    """Node times summed per ORT op type."""
    grouped: collections.Counter = collections.Counter()
    for (op, _node, _shapes), us in times.items():
        grouped[op] += us
    return grouped


def by_family(times: collections.Counter) -> collections.Counter:
    grouped: collections.Counter = collections.Counter()
    for op, us in times.items():
        grouped[family(op)] += us
    return grouped


def table(eager: collections.Counter, lazy: collections.Counter) -> list[str]:
    """Markdown: per family, ms per step and share of the kernel time, eager and lazygrad."""
    families, eager_total, lazy_total = by_family(eager), sum(eager.values()), sum(lazy.values())
    lazy_families = by_family(lazy)
    lines = [
        "| family | eager ms | eager share | lazygrad ms | lazygrad share |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    order = sorted(set(families) | set(lazy_families), key=lambda f: -lazy_families[f])
    for name in order:
        lines.append(
            f"| {name} | {families[name] / 1e3:.1f} | {families[name] / eager_total:.0%} | "
            f"{lazy_families[name] / 1e3:.1f} | {lazy_families[name] / lazy_total:.0%} |"
        )
    lines.append(f"| total | {eager_total / 1e3:.1f} | | {lazy_total / 1e3:.1f} | |")
    return lines


def top(times: collections.Counter, count: int) -> list[str]:
    total = sum(times.values())
    return [f"  {' '.join(op) if isinstance(op, tuple) else op:60s} {us / 1e3:8.2f} ms "
            f"{us / total:5.1%}" for op, us in times.most_common(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("workload", nargs="?", default="bert loss", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--graphs", type=Path, help="write the graphs ORT optimised here")
    parser.add_argument("--nodes", type=int, default=0, help="list the N slowest ORT nodes")
    args = parser.parse_args(argv)
    os.environ["LAZYGRAD_CACHE_DIR"] = ""  # every graph built: what the check runs is current
    os.environ["LAZYGRAD_WAIT_FOR_BUILDS"] = "1"
    if args.graphs is not None:
        args.graphs.mkdir(parents=True, exist_ok=True)
    workload = WORKLOADS[args.workload]
    eager = eager_profile(workload, args.steps)
    nodes = lazy_profile(workload, args.steps, args.graphs)
    lazy = by_op(nodes)
    eager_again = eager_profile(workload, args.steps)  # the load may have changed meanwhile
    eager = collections.Counter({op: (eager[op] + eager_again[op]) / 2 for op in eager})
    print(f"{workload.name}: {args.steps} steady steps, load average {os.getloadavg()[0]:.1f}")
    print("\n".join(table(eager, lazy)))
    print("\neager, top ATen ops (self time per step):")
    print("\n".join(top(eager, 15)))
    print("\nlazygrad, top ORT op types (kernel time per step, forward + backward):")
    print("\n".join(top(lazy, 15)))
    if args.nodes:
        print("\nlazygrad, slowest ORT nodes (op type, node, output shapes):")
        print("\n".join(top(nodes, args.nodes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
