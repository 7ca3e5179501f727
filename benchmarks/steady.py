"""`python -m benchmarks.steady [WORKLOAD ...] [--rounds N] [--ablate [PEER ...]]`: steady step.

Against eager: eager PyTorch and lazygrad step in turn (timing.interleave: rotating order, the
ratio is the median over rounds of lazygrad's step over eager's in the same round), after each
model's warm-up (its graphs built). `--ablate` adds lazygrad peers built without the peephole
rewrites (capture/peephole.py), without the cap on ORT's constant folding (session.py: every
constant folded, whatever its size), with ORT's threads never spinning (session.py: they spin
within a run by default), with selections of zeros left ORT's Where (capture/zero_where.py),
with the backward's `exp(log_softmax)` left two passes (peephole.softmax_for_exp), with the
outputs an Identity copies left copies (capture/identity_outputs.py), with a loss's ignored rows
computed in its forward and backward (capture/ignored_rows.py), with ORT's CPU memory
arena (session.py), with layer-wise recomputation (`recompute_layers`, capture/layers.py:
its cost) and with the backward in two segments at most (the default before 2026-12-07: its
memory against its time), so each one's effect is measured in the same rounds as the rest,
under the same load; `--ablate` followed by words keeps only the peers whose names hold one of
them. `--no-openmp-pause` runs every lazygrad peer with torch's OpenMP threads left spinning as
an ORT run starts (openmp.py): a runtime switch, so it is measured by runs of its own, paired with
runs without it; as a peer it would run right after the other lazygrad peer in every round (the
rotation keeps the peers' cyclic order) and find the threads that peer ended. The load
average is printed before and after: on a shared machine absolute times drift, ratios much
less. Each step's process CPU time (user + system, all threads) is recorded too: the work a
step does, which waiting for a core under load does not inflate.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import lazygrad
from benchmarks.timing import interleave, paired_ratio
from benchmarks.workloads import WORKLOADS
from lazygrad import openmp, session
from lazygrad.capture import identity_outputs, ignored_rows, peephole, zero_where

# peer -> (what its graphs are built without, its options to lazygrad.lazy)
ABLATIONS: dict[str, tuple[tuple[str, ...], dict]] = {
    "lazygrad, no peephole": (("peephole",), {}),
    "lazygrad, constants folded uncapped": (("folding cap",), {}),
    "lazygrad, never spinning": (("spinning within runs",), {}),
    "lazygrad, Where kept": (("zero where",), {}),
    "lazygrad, exp of log-softmax": (("softmax",), {}),
    "lazygrad, Identity copies": (("identity outputs",), {}),
    "lazygrad, ignored rows computed": (("ignored rows",), {}),
    "lazygrad, arena": ((), {"arena": True}),
    "lazygrad, recompute_layers": ((), {"recompute_layers": True}),
    "lazygrad, 2 segments": ((), {"segments": 2}),
}


@contextlib.contextmanager
def without(parts: tuple[str, ...]) -> Iterator[None]:
    """Graphs built inside the block lack `parts` ("peephole": its rewrites; "folding cap":
    the cap on ORT's constant folding; "spinning within runs": ORT's threads never spin; "zero
    where": no selection of zeros made a product, for the sessions made in the block; "softmax":
    the peephole rule `softmax_for_exp`; "identity outputs": an output an Identity copies stays
    a copy; "ignored rows": a loss's ignored rows computed in its forward and backward)."""
    rules, cap, spinning = peephole.RULES, session.FOLDED_AT_MOST, session.SPINNING
    smallest, sourced = zero_where.SMALLEST, identity_outputs.made_by_their_source
    skipping = ignored_rows.rewrite, ignored_rows.rewrite_forward
    if "peephole" in parts:
        peephole.RULES = []
    if "softmax" in parts:
        peephole.RULES = [rule for rule in rules if rule is not peephole.softmax_for_exp]
    if "identity outputs" in parts:
        identity_outputs.made_by_their_source = lambda model: model
    if "folding cap" in parts:
        session.FOLDED_AT_MOST = 0  # ORT's "no cap"
    if "spinning within runs" in parts:
        session.SPINNING = "off"
    if "zero where" in parts:
        zero_where.SMALLEST = 1 << 62
    if "ignored rows" in parts:
        ignored_rows.rewrite = ignored_rows.rewrite_forward = lambda gm, inputs: 0
    try:
        yield
    finally:
        peephole.RULES, session.FOLDED_AT_MOST, session.SPINNING = rules, cap, spinning
        zero_where.SMALLEST, identity_outputs.made_by_their_source = smallest, sourced
        ignored_rows.rewrite, ignored_rows.rewrite_forward = skipping


def cpu_timed(step: Callable[[int], None], into: list[float]) -> Callable[[int], None]:
    def run(index: int) -> None:
        started = time.process_time()
        step(index)
        into.append(time.process_time() - started)

    return run


def measure(name: str, rounds: int, ablate: list[str] | None) -> str:
    """`ablate`: None, no ablation peers; [], all of them; else those whose names hold a word."""
    workload = WORKLOADS[name]
    models = {"eager": workload.model(), "lazygrad": lazygrad.lazy(workload.model())}
    if ablate is not None:
        models.update({peer: lazygrad.lazy(workload.model(), **options)
                       for peer, (_, options) in ABLATIONS.items()
                       if not ablate or any(word in peer for word in ablate)})
    steps = {peer: workload.step(model) for peer, model in models.items()}
    for peer, step in steps.items():
        with without(ABLATIONS.get(peer, ((), {}))[0]):
            for index in range(workload.settle):
                step(index)
            if peer != "eager":
                lazygrad.wait_for_builds(models[peer])
    load = os.getloadavg()[0]
    cpu: dict[str, list[float]] = {peer: [] for peer in steps}
    timed = {peer: cpu_timed(step, cpu[peer]) for peer, step in steps.items()}
    samples = interleave(timed, rounds * workload.cycle, first_round=workload.settle)
    eager = samples["eager"].times
    parts = [f"{name}: load {load:.1f}-{os.getloadavg()[0]:.1f}, {len(eager)} rounds, "
             f"eager {statistics.median(eager) * 1e3:.1f} ms"]
    for peer, sample in samples.items():
        if peer == "eager":
            continue
        stats = lazygrad.stats(models[peer])
        parts.append(f"{peer} {paired_ratio(sample.times, eager):.3f}x "
                     f"(CPU {paired_ratio(cpu[peer], cpu['eager']):.3f}x)"
                     + (f" ({stats.fallbacks} fallbacks)" if stats.fallbacks else "")
                     + (f" (in parts: {stats.breaks} breaks)" if stats.breaks else ""))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.steady", description=__doc__)
    parser.add_argument("workloads", nargs="*", default=["bert loss"],
                        help=f"any of {sorted(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (cycles for MoE)")
    parser.add_argument("--ablate", nargs="*", metavar="PEER",
                        help="also without each speed-up (or those named)")
    parser.add_argument("--no-openmp-pause", action="store_true",
                        help="leave torch's OpenMP threads spinning as ORT runs start")
    args = parser.parse_args(argv)
    openmp.ENABLED = not args.no_openmp_pause
    os.environ["LAZYGRAD_CACHE_DIR"] = ""  # every graph built by this code
    os.environ["LAZYGRAD_WAIT_FOR_BUILDS"] = "1"
    for name in args.workloads:
        print(measure(name, args.rounds, args.ablate), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
