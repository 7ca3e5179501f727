"""Segmented backward: whole-process peaks per segment count, and the steady step time.

`python -m benchmarks.segments` runs the training loop of `benchmarks.memory` (fresh processes,
builds waited for, so every step after the first runs through ORT) for eager and for lazygrad's
default policy with the backward in 1 graph (as before), 2, 4, 8 or 16 segments (workload A: 1 and
the default). Each lazygrad configuration runs twice: "cold" (an empty disk cache: the first
step pays the build) and "warm" (a second process that loads the graphs the first stored, as a
user's next run does: its peak is the training steps' own, not the build's). Then, in this
process, the steady step of 1 segment against the default count, interleaved step by step (the
machine is shared: only that ratio means anything). Prints the markdown tables of the
"Segmented backward" section of `results/memory.md`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import memory

COUNTS = (1, 2, 4, 8, 16)
STEPS = 4


def plan() -> list[tuple[str, int | None]]:
    """(workload, segment count; None: eager) of every configuration measured."""
    from lazygrad.options import SEGMENTS

    return [("B", None), *(("B", count) for count in COUNTS),
            ("A", None), ("A", 1), ("A", SEGMENTS)]


def peaks(configs: list[tuple[str, int | None]]) -> dict[tuple[str, str, str, str], float]:
    """(workload, config, cache, loop) -> whole-process peak MiB."""
    from lazygrad.options import SEGMENTS

    os.environ["LAZYGRAD_WAIT_FOR_BUILDS"] = "1"  # inherited by the probes
    found = {}
    for workload, count in configs:
        batch = memory.WORKLOADS[workload].batch
        name = "eager" if count is None else f"{count} segment{'s' * (count > 1)}"
        cache = tempfile.mkdtemp(prefix="lazygrad-segments-cache-")
        runs = [("cold", "keep")] if count is not None else [("-", "keep"), ("-", "del")]
        if count is not None:
            runs += [("warm", "keep")] + ([("warm", "del")] if count == SEGMENTS else [])
        try:
            for kind, loop in runs:
                spec = memory._train_spec(workload, "eager" if count is None else "predict",
                                          loop, batch, STEPS)
                spec["segments"] = count
                run = memory._checked(memory.run_fresh(spec, cache=cache))
                found[(workload, name, kind, loop)] = run.peak_mib
                print(f"{workload} {name:<10} {kind:<4} {loop:<4} peak {run.peak_mib:6.0f} "
                      f"MiB steps {', '.join(f'{s:.2f}' for s in run.step_s)}",
                      file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return found


def step_ratio(workload: str, rounds: int) -> tuple[float, dict]:
    """Median over rounds of (default-count step / 1-segment step), steps interleaved in this
    process; and the build phases of each."""
    import torch
    import torch.nn.functional as F

    import lazygrad
    from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch
    from lazygrad.options import SEGMENTS

    shape = memory.WORKLOADS[workload]
    config = BertConfig(vocab=shape.vocab, hidden=shape.hidden, layers=shape.layers,
                        heads=shape.heads)
    batch = bert_batch(config, batch=shape.batch, seq=shape.seq)
    models, optimizers = {}, {}
    for count in (1, SEGMENTS):
        torch.manual_seed(0)
        models[count] = lazygrad.lazy(BertPretraining(config), segments=count,
                                      wait_for_builds=True)
        optimizers[count] = torch.optim.AdamW(models[count].parameters(), lr=1e-4)

    def step(count: int) -> float:
        started = time.perf_counter()
        out = models[count](*batch)
        loss = F.cross_entropy(out[2], batch[2]) if shape.trains == "nsp" else out[0]
        loss.backward()
        optimizers[count].step()
        optimizers[count].zero_grad()
        return time.perf_counter() - started

    for _ in range(3):  # the build, then warm sessions
        for count in models:
            step(count)
    ratios = []
    for index in range(rounds):
        order = list(models) if index % 2 == 0 else list(reversed(models))
        seconds = {count: step(count) for count in order}
        ratios.append(seconds[SEGMENTS] / seconds[1])
    phases = {count: lazygrad.stats(model).entries[0].phases for count, model in models.items()}
    return statistics.median(ratios), phases


def main() -> int:
    from lazygrad.options import SEGMENTS

    # `W:N` arguments (W:eager for eager) measure those configurations only.
    chosen = [(w, None if n == "eager" else int(n))
              for w, n in (arg.split(":") for arg in sys.argv[1:])] or plan()
    found = peaks(chosen)
    lines = ["| workload | config | first run (cold cache), keep | next run (warm cache), keep "
             "/ del | warm x eager (keep / del) |", "| --- | --- | ---: | ---: | ---: |"]
    configs = dict.fromkeys((w, c) for w, c, _, _ in found)
    for workload, config in configs:
        eager = [found.get((workload, "eager", "-", loop), float("nan")) for loop in memory.LOOPS]
        if config == "eager":
            lines.append(f"| {workload} | eager | {eager[0]:.0f} | {eager[0]:.0f} / "
                         f"{eager[1]:.0f} | 1.00 / 1.00 |")
            continue
        warm = [found.get((workload, config, "warm", loop)) for loop in memory.LOOPS]
        shown = " / ".join(f"{w:.0f}" for w in warm if w is not None)
        ratios = " / ".join(f"{w / e:.2f}" for w, e in zip(warm, eager) if w is not None)
        lines.append(f"| {workload} | {config} | {found[(workload, config, 'cold', 'keep')]:.0f} "
                     f"| {shown} | {ratios} |")
    print("\n".join(lines), flush=True)
    ratio, phases = step_ratio("B", rounds=8)
    print(f"\nB: steady step, {SEGMENTS} segments / 1 segment (median of 8 interleaved "
          f"rounds): {ratio:.3f}x; build phases (s): "
          + "; ".join(f"{count}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items())
                      for count, p in phases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
