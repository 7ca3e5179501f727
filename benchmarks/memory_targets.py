"""`python -m benchmarks.memory_targets`: issue 10's whole-process peaks and largest batches.

The full `python -m benchmarks.memory` run (every policy, both loops, batch searches in cold
processes) takes over an hour now that a lazy loop runs until ORT serves steady steps. This
measures the targets' figures (about an hour; `--no-batches`: the peaks alone, 25 minutes):

- Peaks: workloads A and B, keep and del loops, eager against lazygrad's default policy, with
  and without `recompute_layers=True` (layer-wise recomputation: one more forward of each layer
  in the backward for a stash of layer inputs, capture/layers.py), and `policy="all"`
  (ORTModule's stash, which A's default must not exceed), each a fresh process
  (`memory.run_fresh`, default allocator) of 4 steps (lazy loops run on until ORT has served
  steps). Each lazygrad config runs twice on one disk cache: "cold" (empty: the build, trace,
  export and check, runs in the process, beside eager steps) and "warm" (a second process of the
  same training: its graphs come from the disk index, so no build runs in it).
  `--repeats N` runs eager and each warm config N times, interleaved, in fresh processes, and
  reports the median with the range: one configuration's peak moves by up to 50 MiB from one
  process to the next (glibc's heap: which freed blocks a later allocation fits in), so a single
  process cannot tell 0.84x from 0.88x. The cold run, which fills the cache, stays one process.
- Largest batch within eager's batch-16 peak (keep loop), bisected, every probe a fresh process
  whose whole-process peak is compared with that budget: eager, lazygrad's default policy (with
  and without `recompute_layers`) and `policy="all"` (ORTModule's pessimistic stash). Lazygrad's
  probes run warm, on the disk cache a batch-16 training filled whose last step was at batch 15:
  the batch size became a symbol there, and the disk index keeps it so, so a process at another
  batch is served by those graphs from its first step, as a user's next run is after a first
  one whose batch size varied (the cold first run is the peaks' "cold" column).

Prints JSON lines and adds the run at the top of `results/memory-targets.md`, under the runs before.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile

from benchmarks import memory

STEPS = 4
SEARCHED = ("eager", memory.DEFAULT, memory.LAYERS, "all")
# The peaks' lazygrad configs (name prefix: config), and each one's column title.
LAZY = {"": memory.DEFAULT, "layers ": memory.LAYERS, "all ": "all"}
TITLES = {"": "lazygrad", "layers ": "recompute_layers", "all ": '"all"'}
HIGH = {"A": 48, "B": 32}  # a batch assumed not to fit the budget
PROBES = 4


def peak(workload: str, config: str, batch: int, loop: str = "keep",
         cache: str | None = None, then_batch: int | None = None) -> memory.Run:
    return memory._checked(memory.run_fresh(
        memory._train_spec(workload, config, loop, batch, STEPS, then_batch=then_batch),
        cache=cache))


def largest_batch(workload: str, config: str, budget: float, cache: str | None) -> memory.Search:
    """Bisected between the batch-16 run (which fits: its peak is the budget, or below it) and
    HIGH; a probe fits when its whole-process peak stays within the budget."""
    def fits(batch: int) -> bool:
        run = peak(workload, config, batch, cache=cache)
        print(json.dumps({"probe": workload, "config": config, "batch": batch,
                          "peak": run.peak_mib, "first ORT step": run.first_served}), flush=True)
        return run.peak_mib <= budget

    return memory.bisect(fits, memory.WORKLOADS[workload].batch, HIGH[workload], PROBES)


def batch_rows(peaks: dict) -> list[str]:
    """The largest-batch table: per workload, each searched config against eager's budget."""
    lines = ["| workload | config | budget MiB | largest batch | x eager | probes |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for workload in ("A", "B"):
        batch = memory.WORKLOADS[workload].batch
        budget = statistics.median(peaks[(workload, "keep")]["eager"])
        searches = {}
        for config in SEARCHED:
            cache = None
            if config != "eager":  # a batch-16 training fills the cache the probes read; its
                # last step, at batch 15, makes the batch size a symbol (`peak`'s then_batch)
                cache = tempfile.mkdtemp(prefix="lazygrad-memory-targets-")
                peak(workload, config, batch, cache=cache, then_batch=batch - 1)
            searches[config] = largest_batch(workload, config, budget, cache)
        for config, search in searches.items():
            ratio = ("1.00" if config == "eager"
                     else memory._ratio_text(memory.batch_ratio(search, searches["eager"])))
            probes = [f"{batch} fits (budget)" if config == "eager" else f"{batch} fits"]
            probes += [f"{b} {'fits' if ok else 'fails'}" for b, ok in search.probes]
            lines.append(f"| {workload} | {memory.label(config)} | {budget:.0f} | {search.text} "
                         f"| {ratio} | {', '.join(probes)} |")
    return lines


TITLE = ("# Issue 10's targets: whole-process peak, cold and warm disk cache, and the largest "
         "batch")


def measure_peaks(workload: str, loop: str, repeats: int) -> dict[str, list[float]]:
    """Each config's peaks in fresh processes: eager's and the warm ones `repeats` times,
    interleaved so that a change of the machine's state between them touches every config."""
    batch = memory.WORKLOADS[workload].batch
    found: dict[str, list[float]] = {}
    caches = {}
    for name, config in LAZY.items():
        caches[name] = tempfile.mkdtemp(prefix="lazygrad-memory-targets-")
        found[f"{name}cold"] = [peak(workload, config, batch, loop, caches[name]).peak_mib]
    for _ in range(repeats):
        found.setdefault("eager", []).append(peak(workload, "eager", batch, loop).peak_mib)
        for name, config in LAZY.items():
            run = peak(workload, config, batch, loop, caches[name])
            found.setdefault(f"{name}warm", []).append(run.peak_mib)
            found.setdefault(f"{name}warm first ORT step", []).append(run.first_served)
    return found


def peak_cell(peaks: list[float], eager: list[float]) -> str:
    """The median peak (x eager's median), with the range where more than one process ran."""
    median = statistics.median(peaks)
    spread = f"; {min(peaks):.0f}-{max(peaks):.0f}" if len(peaks) > 1 else ""
    return f"{median:.0f} ({median / statistics.median(eager):.2f}x{spread})"


def eager_cell(peaks: list[float]) -> str:
    """Eager's median peak, with the range where more than one process ran."""
    spread = f" ({min(peaks):.0f}-{max(peaks):.0f})" if len(peaks) > 1 else ""
    return f"{statistics.median(peaks):.0f}{spread}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_targets")
    parser.add_argument("--no-batches", action="store_true", help="the peaks alone (25 min)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes for eager and each warm config (median reported)")
    args = parser.parse_args(argv)
    peaks = {}
    for workload in ("A", "B"):
        for loop in ("keep", "del"):
            peaks[(workload, loop)] = found = measure_peaks(workload, loop, args.repeats)
            print(json.dumps({"workload": workload, "loop": loop, **found}), flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    processes = (f"median of {args.repeats} fresh processes each (range after the ratio; the "
                 "cold run one process)" if args.repeats > 1 else "one process each")
    lines = [
        f"## {stamp} (`python -m benchmarks.memory_targets`)",
        "",
        f"Load average {os.getloadavg()[0]:.1f} at the end. Peak MiB (x eager), {processes}; "
        "default policy, with `recompute_layers=True`, and `policy=\"all\"` (ORTModule's stash).",
        "",
        "| workload | loop | eager | "
        + " | ".join(f"{TITLES[name]}, {kind}" for name in LAZY for kind in ("cold", "warm"))
        + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in range(2 * len(LAZY))) + " |",
    ]
    for (workload, loop), found in peaks.items():
        cells = [peak_cell(found[f"{name}{kind}"], found["eager"])
                 for name in LAZY for kind in ("cold", "warm")]
        lines.append(f"| {workload} | {loop} | {eager_cell(found['eager'])} | "
                     + " | ".join(cells) + " |")
    if not args.no_batches:
        lines += ["", "Largest batch within eager's batch-16 peak (keep loop; lazygrad warm):", "",
                  *batch_rows(peaks)]
    path = memory.RESULTS / "memory-targets.md"
    path.write_text(newest_first(path.read_text() if path.exists() else "", lines))


def newest_first(previous: str, section: list[str]) -> str:
    """The results file with this run's section first, under the title: the file keeps every
    run, with what was learned from each, and a run must not write over them."""
    _, _, runs = previous.partition("\n")
    return "\n".join([TITLE, "", *section, "", runs.lstrip("\n")]).rstrip("\n") + "\n"


if __name__ == "__main__":
    main()
