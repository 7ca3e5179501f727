"""`python -m benchmarks.faults [WORKLOAD ...] [--pairs N] [--steps N]`: steady steps' page faults.

ORT's kernels in this graph's shapes, timed alone (a GEMM, a Softmax over the vocabulary head's
logits), are as fast as torch's; inside a step both systems also pay the kernel's minor page
faults: a freshly allocated block that glibc has just given back to the system faults in again,
page by page, as it is first written. How many a step pays depends on the process's heap (its top
is returned to the system when it is free and large), not on the model alone: so each peer runs
alone in a fresh process, as a user's training does, and the processes are alternated round by
round (eager; lazygrad on an empty disk cache, whose graphs are built in the process; lazygrad on
the cache that process filled, as a user's next run), under the default allocator and under glibc
told to keep what it frees (`MALLOC_MMAP_THRESHOLD_` 32 MiB, `MALLOC_TRIM_THRESHOLD_` 1 GiB; a
process-wide setting that a library must not make for its user). Per peer: the median steady step,
its ratio to eager's process of the same round (median over rounds), the minor faults per step
and, for lazygrad, those inside ORT's runs. First, the kernels alone (`kernels`): the BERT-shaped
workload's vocabulary head, each op one ORT session against torch's op, writing into outputs
allocated once, so neither faults. Prints markdown and writes `results/faults.md`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy
import onnx
import onnx.helper
import onnxruntime
import torch

from benchmarks.timing import paired_ratio, timed

RESULTS = Path(__file__).parent / "results" / "faults.md"
KEEPING = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
ALLOCATORS = {"default": {}, "glibc keeps freed memory": KEEPING}
PEERS = ("eager", "lazygrad, cold cache", "lazygrad, warm cache")


# The vocabulary head of the BERT-shaped workload (batch 8 x seq 128 rows, hidden 256, vocab 8000):
# (name, ONNX op, its attributes, operand shapes, torch's op writing into `out`)
HEAD_OPS = (
    ("logits h W^T + b", "Gemm", {"transB": 1}, ((1024, 256), (8000, 256), (8000,)),
     lambda h, w, b, out: torch.addmm(b, h, w.t(), out=out)),
    ("weight gradient g^T h", "Gemm", {"transA": 1}, ((1024, 8000), (1024, 256)),
     lambda g, h, out: torch.mm(g.t(), h, out=out)),
    ("input gradient g W", "MatMul", {}, ((1024, 8000), (8000, 256)),
     lambda g, w, out: torch.mm(g, w, out=out)),
    ("softmax of the logits", "Softmax", {"axis": 1}, ((1024, 8000),),
     lambda x, out: torch.softmax(x, 1, out=out)),
    ("scaled by rows", "Mul", {}, ((1024, 8000), (1024, 1)),
     lambda x, r, out: torch.mul(x, r, out=out)),
    ("plus a cotangent", "Add", {}, ((1024, 8000), (1024, 8000)),
     lambda x, y, out: torch.add(x, y, out=out)),
)


def kernels(runs: int = 5) -> list[str]:
    """The head's ops alone, ORT against torch, each on torch's intra-op thread count: median
    milliseconds over 3 blocks of `runs` runs of one system, the blocks alternating, ORT's result
    checked against torch's. Blocks, not alternate runs: right after a parallel torch op its
    OpenMP threads spin on for several milliseconds (libgomp's default wait policy), and an ORT
    run started then shares the cores with them, which the last column measures (each ORT run
    right after the torch op): alternating runs would time ORT only so."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # lazygrad's thread settings (session.py): ORT's threads stop spinning when a run returns,
    # or torch's next op would wait for cores they hold
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    lines = ["| head op | ORT ms | torch ms | ORT ms, right after torch's op |",
             "| --- | ---: | ---: | ---: |"]
    for name, op, attributes, shapes, torch_op in HEAD_OPS:
        names = [f"x{i}" for i in range(len(shapes))]
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node(op, names, ["y"], **attributes)], "op",
            [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(shape))
             for n, shape in zip(names, shapes, strict=True)],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
        session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                               providers=["CPUExecutionProvider"])
        inputs = [torch.rand(shape) for shape in shapes]
        out = torch_op(*inputs, out=torch.empty(0))
        ort_out = torch.empty_like(out)
        binding = session.io_binding()
        for input_name, tensor in zip(names, inputs, strict=True):
            binding.bind_cpu_input(input_name, tensor.numpy())
        binding.bind_output("y", "cpu", 0, numpy.float32, list(out.shape), ort_out.data_ptr())
        calls = {"ORT": functools.partial(session.run_with_iobinding, binding),
                 "torch": functools.partial(torch_op, *inputs, out=out)}
        times: dict[str, list[float]] = {system: [] for system in (*calls, "after")}
        for _ in range(3):  # blocks of one system's runs, the first of each untimed
            for system, call in calls.items():
                call()
                times[system] += [timed(call) for _ in range(runs)]
            for _ in range(runs):  # ORT right after torch's op
                calls["torch"]()
                times["after"].append(timed(calls["ORT"]))
        torch.testing.assert_close(ort_out, out, rtol=1e-4, atol=1e-4)
        lines.append("| " + " | ".join([name, *(f"{statistics.median(times[system]) * 1e3:.2f}"
                                                 for system in ("ORT", "torch", "after"))]) + " |")
    return [*lines, ""]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _child(workload_name: str, lazy: bool, steps: int) -> dict:
    """Inside a fresh process: the steady steps' seconds and faults (all, and inside ORT)."""
    import lazygrad
    from benchmarks.workloads import WORKLOADS
    from lazygrad import session

    in_ort = [0]
    run = session._Binding.run

    def counted(binding: session._Binding, inputs: list) -> list:
        before = _minor_faults()
        try:
            return run(binding, inputs)
        finally:
            in_ort[0] += _minor_faults() - before

    session._Binding.run = counted
    workload = WORKLOADS[workload_name]
    model = workload.model()
    if lazy:
        model = lazygrad.lazy(model)
    step = workload.step(model)
    for index in range(workload.settle):
        step(index)
    if lazy:
        lazygrad.wait_for_builds(model)
    for index in range(workload.settle, 2 * workload.settle):  # every mask served once more
        step(index)
    seconds = []
    faults, in_ort[0] = _minor_faults(), 0
    for index in range(2 * workload.settle, 2 * workload.settle + steps):
        started = time.perf_counter()
        step(index)
        seconds.append(time.perf_counter() - started)
    faults = _minor_faults() - faults
    return {"step_s": statistics.median(seconds), "faults": faults / steps,
            "ort_faults": in_ort[0] / steps if lazy else None,
            "fallbacks": lazygrad.stats(model).fallbacks if lazy else None}


def _fresh(workload: str, lazy: bool, steps: int, cache: str, allocator: dict) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update(allocator, LAZYGRAD_CACHE_DIR=cache, LAZYGRAD_WAIT_FOR_BUILDS="1")
    spec = json.dumps({"workload": workload, "lazy": lazy, "steps": steps})
    done = subprocess.run([sys.executable, "-m", "benchmarks.faults", "--child", spec], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(workload: str, pairs: int, steps: int) -> dict[tuple[str, str], list[dict]]:
    """(allocator, peer) -> one row per round; the peers of a round run one after another."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(pairs):
        # the cold process fills the cache the warm one reads, so it always runs before it
        order = PEERS if round_index % 2 == 0 else (*PEERS[1:], PEERS[0])
        for allocator, settings in ALLOCATORS.items():
            with tempfile.TemporaryDirectory(prefix="bench-faults-cache-") as cache:
                for peer in order:
                    lazy = peer != "eager"
                    row = _fresh(workload, lazy, steps, cache if lazy else "", settings)
                    if row["fallbacks"]:
                        raise RuntimeError(f"{workload}: lazygrad fell back: {row}")
                    rows.setdefault((allocator, peer), []).append(row)
    return rows


def table(workload: str, rows: dict[tuple[str, str], list[dict]]) -> list[str]:
    lines = [f"### {workload}", "",
             "| allocator | peer | median step ms | x eager | faults per step | in ORT's runs |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for allocator in ALLOCATORS:
        eager = [row["step_s"] for row in rows[allocator, "eager"]]
        for peer in PEERS:
            found = rows[allocator, peer]
            times = [row["step_s"] for row in found]
            in_ort = [row["ort_faults"] for row in found if row["ort_faults"] is not None]
            lines.append(
                f"| {allocator} | {peer} | {statistics.median(times) * 1e3:.1f} | "
                f"{paired_ratio(times, eager):.3f} | "
                f"{statistics.median(row['faults'] for row in found):.0f} | "
                f"{f'{statistics.median(in_ort):.0f}' if in_ort else '—'} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__)
    parser.add_argument("workloads", nargs="*", default=["bert all three", "moe aux every 4th"])
    parser.add_argument("--pairs", type=int, default=3, help="rounds of fresh processes")
    parser.add_argument("--steps", type=int, default=20, help="timed steady steps per process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(_child(spec["workload"], spec["lazy"], spec["steps"])))
        return 0
    started = time.perf_counter()
    lines = ["## The BERT-shaped workload's vocabulary head, kernels alone", "", *kernels()]
    print("\n".join(lines), flush=True)
    for workload in args.workloads:
        steps = args.steps if workload.startswith("bert") else args.steps * 50
        found = table(workload, measure(workload, args.pairs, steps))
        print("\n".join(found), flush=True)
        lines += found
    load = os.getloadavg()[0]
    lines.append(f"- {datetime.datetime.now():%Y-%m-%d %H:%M}, {args.pairs} rounds, "
                 f"{(time.perf_counter() - started) / 60:.1f} min, load average {load:.1f} at "
                 "the end; lazygrad had 0 fallbacks in every process.")
    RESULTS.write_text("# Page faults of a steady step, each peer in its own process\n\n"
                       + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
