"""`python -m benchmarks [--quick] [--out DIR]`: lazygrad against its peers, table and plot.

Order of a run: fresh processes first (first step and peak memory per peer and workload), then
the interleaved timing of all peers in this process, then the per-call overhead; the table is
printed and written to DIR/results.md, the plot to DIR/steps.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnxruntime
import torch
from torch import nn

from benchmarks import fresh, overhead, peers, report
from benchmarks.peers import COMPILE, EAGER
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
    overhead_blocks: int


FULL = Plan(tuple(COMPOSITIONS), 5, 200, (64, 96, 128, 160, 192, 224, 256), True, 15)
QUICK = Plan(("loss",), 3, 200, (64, 160, 256), False, 5)


class Progress:
    """One line per configuration, with the time since the run began."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", flush=True)


def _fresh_runs(plan: Plan, names: list[str], say: Progress) -> dict[tuple[str, str], fresh.Fresh]:
    """First step and peak memory of every (workload, peer), each peer in fresh processes.

    eager and torch.compile run the compositions in one process (torch gives memory back between
    them); lazygrad gets a process per composition, since its sessions are per grad mask.
    """
    bert = [f"bert {c}" for c in plan.compositions]
    jobs: list[tuple[str, list[str]]] = []
    for peer in names:
        groups = [bert] if peer in (EAGER, COMPILE) else [[w] for w in bert]
        jobs += [(peer, group) for group in [*groups, [MOE.name]]]
    found = {}
    for peer, group in jobs:
        for result in fresh.measure(peer, group):
            found[(result.workload, peer)] = result
            say(
                f"fresh process  {peer:<14} {result.workload:<20} first step "
                f"{result.first_step_s:6.2f} s  peak {result.peak_mib:5.0f} MiB"
            )
    return found


def _rows(
    workload: Workload,
    models: dict[str, nn.Module],
    samples: dict[str, Samples],
    compiled_before: int,
    found: dict[tuple[str, str], fresh.Fresh],
    with_throughput: bool,
) -> list[report.Row]:
    rows = []
    for peer, model in models.items():
        times = samples[peer].times
        built = peers.builds(peer, model, compiled_before)
        cold = found.get((workload.name, peer))
        rows.append(
            report.Row(
                workload=workload.name,
                peer=peer,
                median_s=samples[peer].median,
                ratio=paired_ratio(times, samples[EAGER].times),
                steps_per_s=len(times) / sum(times) if with_throughput else None,
                first_step_s=cold.first_step_s if cold else None,
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
) -> list[report.Row]:
    """Warm-up rounds (untimed, counted in builds and hits), then `rounds` timed rounds."""
    for peer, model in models.items():
        peers.reset(peer, model)
    before = peers.compiled_graphs()
    steps = {peer: workload.step(model) for peer, model in models.items()}
    interleave(steps, warmup)
    samples = interleave(steps, rounds, first_round=warmup)
    return _rows(workload, models, samples, before, found, with_throughput)


def run(plan: Plan, say: Progress) -> tuple[list[report.Row], overhead.Overhead]:
    names = [p for p in peers.PEERS if plan.compile or p != COMPILE]
    found = _fresh_runs(plan, names, say)
    rows: list[report.Row] = []

    bert_base = WORKLOADS["bert loss"].model()
    kept = {p: peers.make(p, bert_base) for p in names if p in (EAGER, COMPILE)}
    carried: dict[str, nn.Module] = {}
    for composition in plan.compositions:
        workload = WORKLOADS[f"bert {composition}"]
        models = {p: kept[p] if p in kept else peers.make(p, bert_base) for p in names}
        phase = _phase(workload, models, plan.rounds, workload.settle, found, False)
        _say_rows(say, phase)
        rows += phase
        carried = carried or models  # the "loss" models go on to the lengths workload

    moe_base = MOE.model()
    moe_models = {p: peers.make(p, moe_base) for p in names}
    phase = _phase(MOE, moe_models, plan.moe_steps, 0, found, True)  # from the first step
    _say_rows(say, phase)
    rows += phase

    lengths = seq_lengths(plan.lengths)
    phase = _phase(lengths, carried, len(plan.lengths), 0, found, True)
    _say_rows(say, phase)
    rows += phase

    cost = overhead.measure(plan.overhead_blocks)
    say(
        f"overhead       lazygrad {cost.lazygrad_us:.0f} us, GraphSession.run "
        f"{cost.session_us:.0f} us, ORT run {cost.ort_us:.0f} us per call"
    )
    return rows, cost


def notes(plan: Plan, quick: bool, cost: overhead.Overhead, seconds: float, load: str) -> list[str]:
    """How every figure was measured, and under which conditions: the reader's key to the table."""
    lines = [
        f"{'quick' if quick else 'full'} run of {datetime.date.today()}, {seconds / 60:.1f} min; "
        f"{os.cpu_count()} CPUs, load average {load} (other jobs share the machine); Python "
        f"{platform.python_version()}, torch {torch.__version__}, onnxruntime "
        f"{onnxruntime.__version__}.",
        "Workload 1: BertPretraining, vocab 8000, hidden 256, 4 layers, batch 8, seq 128; "
        "a step is zero_grad, forward, the composed loss, backward (no optimizer: it is the same "
        "for every peer). 'loss + scores' adds scores.mean(), 'all three' also nsp.mean(). "
        f"Workload 2: MoELayer hidden {MOE_HIDDEN}, {MOE_EXPERTS} experts, input "
        f"{'x'.join(map(str, MOE_SHAPE))}; loss out.pow(2).mean(), plus 0.01 * aux_loss on "
        "every 4th step. Workload 3: workload 1's loss at sequence lengths "
        f"{', '.join(map(str, plan.lengths))} (one shuffled pass), on the models that ran the "
        "'bert loss' rows at seq 128 just before.",
        "median step / x eager: every peer steps once per round, in an order that rotates from "
        "round to round; x eager is the median over rounds of the step time divided by eager's "
        f"step time in the same round. Workload 1: {plan.rounds} timed rounds per composition "
        "after 2 untimed warm-up rounds; workload 2: every step from the first; workload 3: "
        "every step.",
        "steps/s (workloads 2 and 3): steps divided by their total time, first steps, rebuilds "
        "and recomputes included.",
        "first step s / peak MiB: fresh processes. lazygrad: one per peer and workload (its "
        "sessions are per grad mask); eager and torch.compile: one per peer for the workload-1 "
        "compositions in turn (only the first one's first step is cold) and one for workload 2. "
        "First step: the first call and its backward: export, graph builds and ORT session "
        "creation for lazygrad, tracing and compilation for torch.compile (inductor cache in a "
        "new directory). Peak: the process's peak resident set (VmHWM, reset after the warm-up "
        "steps) over one cycle of steady steps, minus the resident set after the model was built; "
        "glibc returns large blocks on free (MALLOC_MMAP_THRESHOLD_=256 KiB). It counts "
        "activations or stashed tensors, gradients, workspaces and cached graphs.",
        "exports / builds / hit rate: lazygrad.stats over the phase, warm-up included; planning "
        "the first stash counts as a build; lazygrad's on-disk graph cache is off "
        "(LAZYGRAD_CACHE_DIR=''), so every graph is built. torch.compile: builds = graphs dynamo "
        "compiled in the phase. Workload-1 lazygrad models are new per composition; the eager and "
        "torch.compile models serve every composition.",
        f"Per-call overhead (ThreeHeadMLP, 6x16 input, eval + no_grad, {plan.overhead_blocks} "
        f"interleaved blocks of 200 calls, medians): lazygrad call {cost.lazygrad_us:.0f} us, "
        f"lazygrad's GraphSession.run {cost.session_us:.0f} us, ORT run_with_iobinding on a "
        f"binding made once {cost.ort_us:.0f} us; lazygrad adds {cost.runtime_us:.0f} us per "
        "call over ORT's own run (target: under 100 us).",
    ]
    if not plan.compile:
        lines.append(
            "torch.compile was skipped (--quick): its first compilation takes 40-100 s here. "
            "--quick also runs only the 'loss' composition, 3 rounds and 3 sequence lengths."
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
    plan = QUICK if args.quick else FULL
    say = Progress()
    load_before = f"{os.getloadavg()[0]:.1f}"
    rows, cost = run(plan, say)
    load = f"{load_before} at start, {os.getloadavg()[0]:.1f} at end"
    seconds = time.perf_counter() - say.start
    text = report.markdown(rows, notes(plan, args.quick, cost, seconds, load))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    report.plot(rows, args.out / "steps.png")
    print(text)
    say(f"wrote {args.out / 'results.md'} and {args.out / 'steps.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
