"""`python -m benchmarks [--quick] [--out DIR]`: lazygrad against its peers, table and plot.

Order of a run: fresh processes first (first step and peak memory per peer and workload), then
the per-call overhead (its tiny model's graph build also warms up lazygrad's tracer and exporter
in this process), then the interleaved timing of all peers in this process; the tables are
printed and written to DIR/results.md, the plot to DIR/steps.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnxruntime
import torch
from torch import nn

from benchmarks import fresh, overhead, peers, report
from benchmarks.ortmodule import measure as ortmodule
from benchmarks.peers import COMPILE, EAGER, LAZY, LAZY_ALL
from benchmarks.timing import Samples, interleave, paired_ratio
from benchmarks.workloads import (
    COMPOSITIONS,
    MOE,
    MOE_EXPERTS,
    MOE_HIDDEN,
    MOE_SHAPE,
    WORKLOADS,
    Workload,
    seq_lengths,
)

RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much a run measures; `--quick` trades samples and torch.compile for time."""

    compositions: tuple[str, ...]  # of workload 1
    rounds: int  # timed rounds per workload-1 composition
    moe_steps: int
    lengths: tuple[int, ...]  # of workload 3, one pass
    compile: bool
    fresh_bert: bool  # workload 1 in fresh processes too (workload 2 always is)
    overhead_blocks: int
    # fresh processes whose first step of workload 1's first composition is the table's (their
    # median), eager's and lazygrad's alternating: one fresh process is a noisy sample of it
    first_step_samples: int = 1


FULL = Plan(tuple(COMPOSITIONS), 5, 200, (64, 96, 128, 160, 192, 224, 256), True, True, 15, 5)
QUICK = Plan(("loss",), 3, 200, (64, 160, 256), False, False, 5)


class Progress:
    """One line per configuration, with the time since the run began."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", flush=True)


def _fresh_runs(plan: Plan, names: list[str], say: Progress) -> dict[tuple[str, str], fresh.Fresh]:
    """First step and peak memory of every (workload, peer), each peer in fresh processes.

    Every peer runs workload 1's compositions in turn on one model in one process, as it does in
    the interleaved run: for lazygrad a later composition's first step is the miss that builds
    its mask. Workload 2 gets a process of its own. lazygrad's peers run each group twice, the
    second process on the disk cache the first one filled.
    """
    groups = [[MOE.name]]
    if plan.fresh_bert:
        groups.insert(0, [f"bert {c}" for c in plan.compositions])
    found = {}
    for peer in names:
        measure = fresh.measure_twice if peer in (LAZY, LAZY_ALL) else fresh.measure
        for group in groups:
            for result in measure(peer, group):
                found[(result.workload, peer)] = result
                warm = result.warm
                say(
                    f"fresh process  {peer:<14} {result.workload:<20} first step "
                    f"{result.first_step_s:6.2f} s  peak {result.peak_mib:5.0f} MiB"
                    + (f"  warm cache: first step {warm.first_step_s:6.2f} s "
                       f"{'through ORT' if warm.through_ort else 'eager'}" if warm else "")
                )
    if plan.fresh_bert:
        _first_step_medians(found, groups[0][0], [p for p in names if p != COMPILE],
                            plan.first_step_samples, say)
    return found


def _first_step_medians(found: dict[tuple[str, str], fresh.Fresh], workload: str,
                        peers: list[str], samples: int, say: Progress) -> None:
    """More fresh processes of `workload` alone for `peers`, alternating, each on an empty
    cache: the table's first step becomes the median of every process's (torch.compile's
    stays one process's: 20-30 s of compilation, not a close call)."""
    first_steps = {peer: [found[(workload, peer)].first_step_s] for peer in peers}
    for _ in range(samples - 1):
        for peer in peers:
            first_steps[peer].append(fresh.measure(peer, [workload])[0].first_step_s)
    for peer, seconds in first_steps.items():
        found[(workload, peer)] = dataclasses.replace(
            found[(workload, peer)], first_step_s=statistics.median(seconds))
        say(f"first step     {peer:<14} {workload:<20} median {statistics.median(seconds):.2f} s "
            f"of {len(seconds)} fresh processes ({min(seconds):.2f}-{max(seconds):.2f} s)")


def _rows(
    workload: Workload,
    models: dict[str, nn.Module],
    samples: dict[str, Samples],
    compiled_before: int,
    found: dict[tuple[str, str], fresh.Fresh],
    with_throughput: bool,
    steady_from: int,
) -> list[report.Row]:
    """Median and x eager over the rounds from `steady_from` on; steps/s over every round."""
    rows = []
    eager = samples[EAGER].times[steady_from:]
    for peer, model in models.items():
        times = samples[peer].times
        steady = Samples(times[steady_from:])
        built = peers.builds(peer, model, compiled_before)
        cold = found.get((workload.name, peer))
        rows.append(
            report.Row(
                workload=workload.name,
                peer=peer,
                median_s=steady.median,
                ratio=paired_ratio(steady.times, eager),
                steps_per_s=len(times) / sum(times) if with_throughput else None,
                first_step_s=cold.first_step_s if cold else None,
                ready_s=cold.ready_s if cold else None,
                building_steps=cold.building_steps if cold else None,
                building_median_s=cold.building_median_s if cold else None,
                warm_first_step_s=cold.warm.first_step_s if cold and cold.warm else None,
                warm_through_ort=cold.warm.through_ort if cold and cold.warm else None,
                peak_mib=cold.peak_mib if cold else None,
                exports=built.exports,
                builds=built.builds,
                hit_rate=built.hit_rate,
            )
        )
    return rows


def _say_rows(say: Progress, rows: list[report.Row]) -> None:
    for row in rows:
        say(
            f"interleaved    {row.peer:<14} {row.workload:<20} median "
            f"{row.median_s * 1e3:7.1f} ms  {row.ratio:5.2f}x eager"
        )


def _phase(
    workload: Workload,
    models: dict[str, nn.Module],
    rounds: int,
    warmup: int,
    found: dict[tuple[str, str], fresh.Fresh],
    with_throughput: bool,
    steady_from: int = 0,
) -> list[report.Row]:
    """Warm-up rounds (untimed, counted in builds and hits), then `rounds` timed rounds."""
    for peer, model in models.items():
        peers.reset(peer, model)
    before = peers.compiled_graphs()
    steps = {peer: workload.step(model) for peer, model in models.items()}
    interleave(steps, warmup)
    samples = interleave(steps, rounds, first_round=warmup)
    return _rows(workload, models, samples, before, found, with_throughput, steady_from)


def _new_builds(
    workload: Workload,
    models: dict[str, nn.Module],
    rows: list[report.Row],
    seen: set[tuple[str, tuple[bool, ...] | None]],
) -> list[report.BuildRow]:
    """The pairs each lazygrad model built in this phase (not in `seen`, which is updated), or
    one row saying it built none; each with the model's steady step from `rows`."""
    ratios = {row.peer: row.ratio for row in rows}
    found = []
    for peer, model in models.items():
        if peer not in (LAZY, LAZY_ALL):
            continue
        new = [e for e in peers.built(peer, model) if (peer, e.mask) not in seen]
        seen.update((peer, e.mask) for e in new)
        found += [
            report.BuildRow(workload.name, peer, e.mask, e.phases, e.build_seconds, ratios[peer])
            for e in new
        ] or [report.BuildRow(workload.name, peer, None, {}, None, ratios[peer])]
    return found


def _say_builds(say: Progress, rows: list[report.BuildRow]) -> None:
    for row in rows:
        if row.mask is not None:
            stages = ", ".join(f"{name} {s:.1f} s" for name, s in row.phases.items())
            say(f"built          {row.peer:<14} mask {report.mask_text(row.mask)}  "
                f"{row.build_s:.1f} s ({stages})")


def run(
    plan: Plan, say: Progress
) -> tuple[list[report.Row], list[report.BuildRow], overhead.Overhead]:
    names = [p for p in peers.PEERS if plan.compile or p != COMPILE]
    found = _fresh_runs(plan, names, say)
    cost = overhead.measure(plan.overhead_blocks)
    say(
        f"overhead       lazygrad {cost.lazygrad_us:.0f} us, GraphSession.run "
        f"{cost.session_us:.0f} us, ORT run {cost.ort_us:.0f} us per call"
    )
    rows: list[report.Row] = []
    builds: list[report.BuildRow] = []

    bert_base = WORKLOADS["bert loss"].model()
    # One model per peer serves every composition in turn, then workload 3.
    models = {p: peers.make(p, bert_base) for p in names}
    seen: set[tuple[str, tuple[bool, ...] | None]] = set()
    for composition in plan.compositions:
        workload = WORKLOADS[f"bert {composition}"]
        phase = _phase(workload, models, plan.rounds, workload.settle, found, False)
        built = _new_builds(workload, models, phase, seen)
        _say_builds(say, built)
        _say_rows(say, phase)
        rows += phase
        builds += built

    moe_base = MOE.model()
    moe_models = {p: peers.make(p, moe_base) for p in names}
    # Timed from the first step (steps/s pays the builds); x eager once every mask ran twice.
    phase = _phase(MOE, moe_models, plan.moe_steps, 0, found, True, MOE.settle)
    _say_rows(say, phase)
    rows += phase

    lengths = seq_lengths(plan.lengths)
    phase = _phase(lengths, models, len(plan.lengths), 0, found, True)
    _say_rows(say, phase)
    rows += phase
    return rows, builds, cost


ORTMODULE = "ORTModule"


def ortmodule_rows(
    plan: Plan, say: Progress,
) -> tuple[list[report.Row], dict[str, str], dict[str, float]]:
    """ORTModule on workloads 1 and 2, each group in one process of its own environment; its
    x eager is against eager PyTorch of that environment, measured interleaved there. Also that
    eager's median step (s) per workload: the two environments' eager steps differ (another
    torch build), which a ratio to each one's own eager hides."""
    rows, versions, its_eager = [], {}, {}
    bert = [f"bert {c}" for c in plan.compositions]
    for group, rounds in ((bert, plan.rounds), ([MOE.name], plan.moe_steps // 4)):
        figures, versions = ortmodule.measure(group, rounds)
        for name, found in figures.items():
            rows.append(report.Row(workload=name, peer=ORTMODULE, median_s=found.median_s,
                                   ratio=found.ratio, first_step_s=found.first_step_s))
            its_eager[name] = found.eager_median_s
            say(f"ORTModule      {name:<20} median {found.median_s * 1e3:7.1f} ms  "
                f"{found.ratio:5.2f}x its eager, first step {found.first_step_s:.2f} s "
                f"(its eager's {found.eager_first_step_s:.2f} s)")
    return rows, versions, its_eager


def against_ortmodule(rows: list[report.Row]) -> str:
    """Issue 11's target: lazygrad's x eager at most 0.7 of ORTModule's x its eager."""
    theirs = {row.workload: row.ratio for row in rows if row.peer == ORTMODULE}
    pairs = [
        f"{row.workload} {row.ratio / theirs[row.workload]:.2f}"
        for row in rows if row.peer == LAZY and row.workload in theirs
    ]
    return ("lazygrad's x eager / ORTModule's x its eager (target <= 0.70): " + ", ".join(pairs)
            + ".")


def eager_steps_beside(rows: list[report.Row], its_eager: dict[str, float]) -> str:
    """Each workload's eager median step in ORTModule's environment beside this run's."""
    ours = {row.workload: row.median_s for row in rows if row.peer == EAGER}
    pairs = [f"{name} {seconds * 1e3:.1f} against {ours[name] * 1e3:.1f} ms"
             for name, seconds in its_eager.items() if name in ours]
    return ("Eager PyTorch's median step in ORTModule's environment against this run's eager: "
            + ", ".join(pairs) + ".")


def ortmodule_notes(rows: list[report.Row], versions: dict[str, str],
                    its_eager: dict[str, float]) -> list[str]:
    if not versions:
        return [
            "ORTModule was not measured: its environment is missing (it needs torch 2.4; "
            "`bash benchmarks/ortmodule/make_env.sh` makes it, about 5 GB)."
        ]
    return [
        f"ORTModule (onnxruntime-training {versions['onnxruntime-training']}, torch "
        f"{versions['torch']}, Python {versions['python']}) ran in its own environment "
        "(`benchmarks/ortmodule/make_env.sh`), in a fresh subprocess per workload group, on the "
        "same models and losses: its x eager is against eager PyTorch of that environment, "
        "interleaved round by round there as here, after the same warm-up steps, each peer's "
        "timed step after 0.15 s of its own untimed steps (ORT's default sessions, which "
        "ORTModule keeps, leave their threads spinning for about 50 ms after a run: eager's MoE "
        "steps right after one took 6.9-7.8 ms, 2.8-3.2 alone; lazygrad's sessions stop "
        "spinning as a run returns, so this run's peers step in plain turns); first step s is "
        "its first call and backward in that process (export, gradient graph, sessions). Its "
        "median step is not comparable with this environment's peers (another torch).",
        against_ortmodule(rows),
        eager_steps_beside(rows, its_eager),
    ]


def notes(plan: Plan, quick: bool, cost: overhead.Overhead, seconds: float, load: str) -> list[str]:
    """How every figure was measured, and under which conditions: the reader's key to the tables."""
    settle = WORKLOADS["bert loss"].settle
    lines = [
        f"{'quick' if quick else 'full'} run of {datetime.date.today()}, {seconds / 60:.1f} min; "
        f"{os.cpu_count()} CPUs, load average {load} (other jobs share the machine); Python "
        f"{platform.python_version()}, torch {torch.__version__}, onnxruntime "
        f"{onnxruntime.__version__}.",
        "Workload 1: BertPretraining, vocab 8000, hidden 256, 4 layers, batch 8, seq 128; "
        "a step is zero_grad, forward, the composed loss, backward (no optimizer: it is the same "
        "for every peer). 'loss + scores' adds scores.mean(), 'all three' also nsp.mean(); each "
        "peer's one model runs the compositions in this order. "
        f"Workload 2: MoELayer hidden {MOE_HIDDEN}, {MOE_EXPERTS} experts, input "
        f"{'x'.join(map(str, MOE_SHAPE))}; loss out.pow(2).mean(), plus 0.01 * aux_loss on "
        "every 4th step. Workload 3: workload 1's loss at sequence lengths "
        f"{', '.join(map(str, plan.lengths))} (one shuffled pass), on the models that ran "
        "workload 1 just before (lazygrad: the first length that differs from workload 1's "
        "128 makes the length a symbol, one more build; its graph serves every length after).",
        "median step / x eager: every peer steps once per round, in an order that rotates from "
        "round to round; x eager is the median over rounds of the step time divided by eager's "
        f"step time in the same round. Workload 1: {plan.rounds} timed rounds per composition "
        f"after {settle} untimed warm-up rounds (lazygrad's first step of a signature runs in "
        "eager PyTorch and builds its mask's graphs at its backward, a new mask builds at its "
        "first backward, and the next step is ORT's first run of the new graphs); workload 2: "
        f"{plan.moe_steps} steps timed from the first, median and x eager over the steps after "
        f"the first {MOE.settle} (each mask seen twice); workload 3: every step.",
        "steps/s (workloads 2 and 3): steps divided by their total time, first steps, builds "
        "and recomputes included.",
        "first step s / peak MiB: fresh processes, one per peer for the workload-1 compositions "
        "in turn (only the first one's first step is cold; for lazygrad a later composition's "
        "first step builds that mask's graphs) and one per peer for workload 2"
        f"{'' if plan.fresh_bert else ' (--quick: workload 2 only)'}"
        + (f"; workload 1's first composition's first step is the median of "
           f"{plan.first_step_samples} fresh processes for eager and lazygrad (the first of "
           "them the table's process, the others that composition alone, the peers "
           "alternating; torch.compile's one process's)"
           if plan.fresh_bert and plan.first_step_samples > 1 else "")
        + ". First step: the first call "
        "and its backward: for lazygrad an eager step that queues the graph build of its mask "
        "(trace, export, check) on the builder thread, started when its backward has ended, as "
        "a user gets it; the loop then steps on (graphs ready s: from that step's start until "
        "its graphs are built; in brackets the steps run eagerly meanwhile, beside the build, "
        "and their median seconds), for "
        "torch.compile tracing and compilation (inductor cache in a new directory). First step "
        "s, warm cache: lazygrad only, a second fresh process of the same workloads on the disk "
        "cache the first one filled (the first ran on an empty one): its first step, and whether "
        "it ran through ORT (no eager step: its graphs came from the disk index, no trace). "
        "Peak: the "
        "process's peak resident set (VmHWM, reset after the warm-up "
        "steps) over one cycle of steady steps, minus the resident set after the model was built; "
        "glibc returns large blocks on free (MALLOC_MMAP_THRESHOLD_=256 KiB). It counts "
        "activations or stashed tensors, gradients, workspaces and cached graphs (for lazygrad "
        "the pairs of every composition run so far).",
        "exports / builds / hit rate: lazygrad.stats over the phase, warm-up included; a build "
        "is one (signature, mask) pair traced, exported and checked; lazygrad's on-disk graph "
        "cache is off here (LAZYGRAD_CACHE_DIR=''; the fresh processes use one of their own), so "
        "every graph is built. torch.compile: builds = "
        "graphs dynamo compiled in the phase.",
        "Build table: per pair a lazygrad model built during a workload-1 phase, the seconds of "
        "each stage (lazygrad.stats(model).entries[i].phases: trace = AOTAutograd on fake "
        "tensors and partition, export = both graphs to ONNX, check = the new pair run once "
        "against its FX graphs in torch) and build s (EntryStats.build_seconds, the stages and "
        "the bookkeeping around them); x eager is that model's steady step from the table above. "
        "'lazygrad all' builds the all-outputs pair once and serves every mask with it. The "
        "per-call overhead's model was built first in this process, so no build here pays the "
        "tracer's and exporter's one-off imports.",
        f"Per-call overhead (ThreeHeadMLP, 6x16 input, eval + no_grad, {plan.overhead_blocks} "
        f"interleaved blocks of 200 calls, medians): lazygrad call {cost.lazygrad_us:.0f} us, "
        f"lazygrad's GraphSession.run {cost.session_us:.0f} us, ORT run_with_iobinding on a "
        f"binding made once {cost.ort_us:.0f} us; lazygrad adds {cost.runtime_us:.0f} us per "
        "call over ORT's own run (target: under 100 us).",
    ]
    if not plan.compile:
        lines.append(
            "torch.compile was skipped (--quick): its first compilation takes 40-100 s here. "
            "--quick also runs only the 'loss' composition, 3 rounds and 3 sequence lengths, "
            "and workload 1 in no fresh process."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples, no torch.compile")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where results.md and "
                        "steps.png go (default: benchmarks/results)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # lazygrad's export warnings would bury the progress lines
    # A new inductor cache: the fresh process's first compile is cold, later ones reuse it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    # No on-disk graph cache: first steps stay cold and every build is counted as one.
    os.environ["LAZYGRAD_CACHE_DIR"] = ""
    # Steady steps are timed on built graphs: warm-up steps wait for their builds here (the
    # fresh processes measure the first step as a user gets it, builds in the background).
    os.environ["LAZYGRAD_WAIT_FOR_BUILDS"] = "1"
    plan = QUICK if args.quick else FULL
    say = Progress()
    load_before = f"{os.getloadavg()[0]:.1f}"
    rows, builds, cost = run(plan, say)
    theirs, versions, its_eager = ortmodule_rows(plan, say)
    rows += theirs
    load = f"{load_before} at start, {os.getloadavg()[0]:.1f} at end"
    seconds = time.perf_counter() - say.start
    described = (notes(plan, args.quick, cost, seconds, load)
                 + ortmodule_notes(rows, versions, its_eager))
    text = report.markdown(rows, described, builds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    print(text)
    try:
        report.plot(rows, args.out / "steps.png")
    except ImportError:  # the `bench` extra's matplotlib, where it cannot be installed
        say(f"wrote {args.out / 'results.md'}; no plot: matplotlib is not installed")
        return 0
    say(f"wrote {args.out / 'results.md'} and {args.out / 'steps.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
