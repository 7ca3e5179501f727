"""`python -m benchmarks.memory_targets`: issue 10's whole-process peaks, cold and warm cache.

The full `python -m benchmarks.memory` run (every policy, both loops, batch searches) takes over
an hour now that a lazy loop runs until ORT serves steady steps. This measures only the targets'
figures: workloads A and B, keep and del loops, eager against lazygrad's default policy, each a
fresh process (`memory.run_fresh`, default allocator) of 4 steps (lazy loops run on until ORT
has served steps). Lazygrad runs twice on one disk cache: "cold" (empty: the build, trace,
export and check, runs in the process, beside eager steps) and "warm" (a second process of the
same training: its graphs come from the disk index, so no build runs in it). Prints JSON lines
and writes `results/memory-targets.md`.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile

from benchmarks import memory

STEPS = 4


def main() -> None:
    rows = []
    for workload in ("A", "B"):
        batch = memory.WORKLOADS[workload].batch
        for loop in ("keep", "del"):
            eager = memory._checked(memory.run_fresh(
                memory._train_spec(workload, "eager", loop, batch, STEPS)))
            cache = tempfile.mkdtemp(prefix="lazygrad-memory-targets-")
            found = {"eager": eager.peak_mib}
            for kind in ("cold", "warm"):
                run = memory._checked(memory.run_fresh(
                    memory._train_spec(workload, memory.DEFAULT, loop, batch, STEPS), cache=cache))
                found[kind] = run.peak_mib
                found[f"{kind} first ORT step"] = run.first_served
            rows.append((workload, loop, found))
            print(json.dumps({"workload": workload, "loop": loop, **found}), flush=True)
    lines = [
        "# Issue 10's targets: whole-process peak, cold and warm disk cache",
        "",
        f"`python -m benchmarks.memory_targets`, {datetime.date.today()}, load average "
        f"{os.getloadavg()[0]:.1f} at the end. Peak MiB (x eager); default policy.",
        "",
        "| workload | loop | eager | lazygrad, cold cache | lazygrad, warm cache |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for workload, loop, found in rows:
        eager = found["eager"]
        lines.append(
            f"| {workload} | {loop} | {eager:.0f} | {found['cold']:.0f} "
            f"({found['cold'] / eager:.2f}x) | {found['warm']:.0f} ({found['warm'] / eager:.2f}x) |"
        )
    (memory.RESULTS / "memory-targets.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
