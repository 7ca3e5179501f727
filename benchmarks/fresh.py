"""First step and peak memory, each peer in a fresh process (`python -m benchmarks.fresh SPEC`).

Fresh, because both figures are about what a process pays once: an eager first step and the graph
build of each grad mask for lazygrad, compilation for torch.compile; and because allocators keep
memory a process once used, so a second configuration in the same process would show the first
one's memory.

Memory is the process's resident set size: the peak over one cycle of steady steps (after the
workload's settling steps) minus the resident size after the model was built, i.e. what training
the model costs beyond holding its weights: activations or stashed intermediates, gradients,
workspaces, arenas, cached graphs. glibc is told to return large blocks to the system on free
(MALLOC_MMAP_THRESHOLD_), so memory freed after the export does not count as held.

lazygrad's first step starts its graph build; the loop then steps on, as a user's does, and the
steps until the graphs serve one run eagerly beside the build: how many, and how long each took
(on 2 cores the build's Python shares the GIL and a core with them), are reported with the time
until the graphs were ready.

lazygrad also runs a second process on the disk cache the first one filled (`measure_twice`): a
second process of the same training, which serves its signatures from the disk index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import warnings

MMAP_THRESHOLD = str(256 * 1024)
_BUILDING_PATIENCE_S = 300.0  # a loop that never gets its graphs stops counting then


@dataclasses.dataclass(frozen=True)
class Fresh:
    """One workload's figures from a fresh process."""

    workload: str
    first_step_s: float
    peak_mib: float
    ready_s: float | None = None  # lazygrad: from the first step's start to its graphs ready
    # lazygrad: the steps after the first that ran eagerly while the graphs built (how many,
    # their median seconds), as a training loop that does not wait runs them
    building_steps: int | None = None
    building_median_s: float | None = None
    through_ort: bool | None = None  # lazygrad: the first step ran no eager step
    warm: Fresh | None = None  # lazygrad: the same in a second process, on a warm disk cache


def measure(peer: str, workloads: list[str], cache: str = "") -> list[Fresh]:
    """Run `workloads` in turn on one model of `peer` in a new process.

    One model across several workloads lets torch.compile and eager share one process (their
    memory is torch's and is given back between workloads); the first workload's first step is
    the only cold one then. `cache`: lazygrad's disk cache (LAZYGRAD_CACHE_DIR; "": none).
    """
    spec = json.dumps({"peer": peer, "workloads": workloads})
    # lazygrad as a user gets it: a step that needs graphs runs eagerly while they build.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD, LAZYGRAD_WAIT_FOR_BUILDS="0",
               LAZYGRAD_CACHE_DIR=cache)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fresh", spec],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"fresh run of {peer} on {workloads} failed:\n{done.stderr[-3000:]}")
    return [Fresh(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def measure_twice(peer: str, workloads: list[str]) -> list[Fresh]:
    """`measure` on an empty disk cache, then again in a second process on the cache the first
    one filled: the first process's rows, each holding the second's (`warm`)."""
    with tempfile.TemporaryDirectory(prefix="bench-lazygrad-cache-") as cache:
        cold = measure(peer, workloads, cache)
        warm = measure(peer, workloads, cache)
    return [dataclasses.replace(c, warm=w) for c, w in zip(cold, warm, strict=True)]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1)) / 1024


def _reset_peak() -> None:
    """Set the kernel's high-water mark (VmHWM) back to the current resident size."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def _run(peer: str, workload_names: list[str]) -> list[Fresh]:
    import time

    import lazygrad
    from benchmarks import peers
    from benchmarks.timing import timed
    from benchmarks.workloads import WORKLOADS

    workloads = [WORKLOADS[name] for name in workload_names]
    model = peers.make(peer, workloads[0].model())
    resting = _status_mib("VmRSS")
    results = []
    for workload in workloads:
        step = workload.step(model)
        lazy = peer in (peers.LAZY, peers.LAZY_ALL)
        eager_steps = lazygrad.stats(model).eager_steps if lazy else 0
        started = time.perf_counter()
        first = timed(lambda step=step: step(0))
        ready = through_ort = building = None
        index = 1
        if lazy:
            through_ort = lazygrad.stats(model).eager_steps == eager_steps
            building = []
            while time.perf_counter() - started < _BUILDING_PATIENCE_S:
                before = lazygrad.stats(model).eager_steps
                took = timed(lambda step=step, index=index: step(index))
                index += 1
                if lazygrad.stats(model).eager_steps == before:
                    break
                building.append(took)
            lazygrad.wait_for_builds(model)
            ready = time.perf_counter() - started
        for _ in range(workload.settle - 1):
            step(index)
            index += 1
        _reset_peak()
        for _ in range(workload.cycle):
            step(index)
            index += 1
        results.append(Fresh(
            workload.name, first, _status_mib("VmHWM") - resting, ready, through_ort=through_ort,
            building_steps=len(building) if building is not None else None,
            building_median_s=statistics.median(building) if building else None,
        ))
    return results


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    request = json.loads(sys.argv[1])
    rows = _run(request["peer"], request["workloads"])
    print(json.dumps([dataclasses.asdict(row) for row in rows]))
