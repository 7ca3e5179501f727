"""The readable end of a run: a markdown table (printed and written) and a plot of the ratios."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

MISSING = "—"


@dataclasses.dataclass(frozen=True)
class Row:
    """One peer on one workload. None: not measured in this run (the notes say why)."""

    workload: str
    peer: str
    median_s: float  # median step time in the interleaved run
    ratio: float  # median over rounds of step time / eager's step time in the same round
    steps_per_s: float | None = None  # over every step of the phase, rebuilds included
    first_step_s: float | None = None  # fresh process: export, build, session creation, compile
    ready_s: float | None = None  # fresh process, lazygrad: first step's start to graphs ready
    building_steps: int | None = None  # fresh process, lazygrad: eager steps meanwhile
    building_median_s: float | None = None  # their median
    # lazygrad: a second fresh process on the disk cache the first filled: its first step, and
    # whether that step ran through ORT (no eager step)
    warm_first_step_s: float | None = None
    warm_through_ort: bool | None = None
    peak_mib: float | None = None  # fresh process: peak RSS over steady steps above resting
    exports: int | None = None
    builds: int | None = None
    hit_rate: float | None = None


@dataclasses.dataclass(frozen=True)
class BuildRow:
    """Graphs one lazygrad peer built during one workload-1 phase, next to its steady step.

    mask None: the phase built nothing (a pair built in an earlier phase serves its mask).
    """

    workload: str
    peer: str
    mask: tuple[bool, ...] | None
    phases: dict[str, float]  # seconds per build stage (lazygrad.EntryStats.phases)
    build_s: float | None  # EntryStats.build_seconds: the stages and the bookkeeping around them
    ratio: float  # steady step / eager's, as in the main table


HEADER = (
    "workload", "peer", "median step ms", "x eager", "steps/s", "first step s",
    "graphs ready s (eager steps meanwhile, median)", "first step s, warm cache", "peak MiB",
    "exports", "builds", "hit rate",
)
PHASES = ("trace", "export", "check")
BUILD_HEADER = (
    "workload", "peer", "mask built", *(f"{phase} s" for phase in PHASES), "build s", "x eager",
    "previous design: x eager *", "previous design: build s *",
)

# The previous design (TorchScript export, onnxruntime-training's gradient builder), quoted and
# not re-measured: x eager from its full run of 2026-12-02 (benchmarks/results/results.md as
# committed in dbe8829: same workloads, same interleaving, default threads), and its graph
# builds per mask and its 1-thread step as issue 8 quotes them.
PREVIOUS_RATIOS = {
    ("bert loss", "lazygrad all"): 1.30,
    ("bert loss", "lazygrad"): 1.14,
    ("bert loss + scores", "lazygrad all"): 1.07,
    ("bert loss + scores", "lazygrad"): 1.09,
    ("bert all three", "lazygrad all"): 1.08,
    ("bert all three", "lazygrad"): 1.20,
}
PREVIOUS_BUILD_S = "0.02-0.06"
PREVIOUS_NOTE = (
    "\\* Previous design (TorchScript export + onnxruntime-training's gradient builder): "
    "figures measured on 2026-12-02, quoted here, not re-measured. x eager: its full run of "
    "2026-12-02 (`benchmarks/results/results.md` as committed in dbe8829: same workloads, same "
    "interleaving, default threads); at 1 thread it measured 1.37x eager on this model (issue 8, "
    "DESIGN.md). Build s: 0.02-0.06 s per mask as issue 8 quotes it: onnxruntime-training's "
    "gradient graph of a forward exported before, whose export (about 1 s per signature) is not "
    "in that figure; here build s covers tracing, exporting and checking both graphs of a mask."
)


def _cell(value: float | int | None, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def cells(row: Row) -> list[str]:
    return [
        row.workload,
        row.peer,
        _cell(row.median_s * 1e3, ".1f"),
        _cell(row.ratio, ".2f"),
        _cell(row.steps_per_s, ".1f"),
        _cell(row.first_step_s, ".2f"),
        _ready_cell(row),
        _warm_cell(row),
        _cell(row.peak_mib, ".0f"),
        _cell(row.exports, "d"),
        _cell(row.builds, "d"),
        _cell(row.hit_rate, ".1%"),
    ]


def _ready_cell(row: Row) -> str:
    if row.ready_s is None:
        return MISSING
    if not row.building_steps:
        return f"{row.ready_s:.1f}"
    return f"{row.ready_s:.1f} ({row.building_steps} eager, {row.building_median_s:.2f} s)"


def _warm_cell(row: Row) -> str:
    if row.warm_first_step_s is None:
        return MISSING
    return f"{row.warm_first_step_s:.2f} ({'ORT' if row.warm_through_ort else 'eager'})"


def mask_text(mask: tuple[bool, ...]) -> str:
    """A grad mask as lazygrad.stats prints it: one digit per output, 1 = got a gradient."""
    return "".join("1" if bit else "0" for bit in mask)


def build_cells(row: BuildRow) -> list[str]:
    previous = PREVIOUS_RATIOS.get((row.workload, row.peer))
    return [
        row.workload,
        row.peer,
        "none new" if row.mask is None else mask_text(row.mask),
        *(_cell(row.phases.get(phase), ".1f") for phase in PHASES),
        _cell(row.build_s, ".1f"),
        _cell(row.ratio, ".2f"),
        _cell(previous, ".2f"),
        PREVIOUS_BUILD_S if row.mask is not None else MISSING,
    ]


def _grid(header: Sequence[str], body: Sequence[list[str]]) -> str:
    """A markdown table, padded so it also reads well in a terminal."""
    lines = [list(header), *body]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def render(line: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


def table(rows: Sequence[Row]) -> str:
    return _grid(HEADER, [cells(row) for row in rows])


def build_table(rows: Sequence[BuildRow]) -> str:
    return _grid(BUILD_HEADER, [build_cells(row) for row in rows])


def markdown(rows: Sequence[Row], notes: Sequence[str], builds: Sequence[BuildRow] = ()) -> str:
    """The whole results file: the peers table, the builds per mask against the previous
    design's figures (when measured), then how each figure was measured."""
    lines = ["# lazygrad benchmarks", "", table(rows), ""]
    if builds:
        lines += [
            "## Build seconds per mask and steady step, workload 1 (BERT-shaped)",
            "",
            build_table(builds),
            "",
            PREVIOUS_NOTE,
            "",
        ]
    return "\n".join([*lines, *(f"- {note}" for note in notes), ""])


def plot(rows: Sequence[Row], path: Path) -> None:
    """Grouped bars of step time / eager per workload, and peak memory where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(row.workload for row in rows))
    peers = list(dict.fromkeys(row.peer for row in rows))
    by_key = {(row.workload, row.peer): row for row in rows}
    width = 0.8 / len(peers)
    figure, (speed, memory) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for offset, peer in enumerate(peers):
        xs = [i + (offset - (len(peers) - 1) / 2) * width for i in range(len(workloads))]
        found = [by_key.get((w, peer)) for w in workloads]
        speed.bar(xs, [r.ratio if r else 0 for r in found], width, label=peer)
        memory.bar(xs, [r.peak_mib if r and r.peak_mib is not None else 0 for r in found], width)
    speed.axhline(1.0, color="black", linewidth=0.8)
    speed.set_ylabel("median step time / eager")
    speed.legend()
    memory.set_ylabel("peak MiB above resting")
    memory.set_xticks(range(len(workloads)))
    memory.set_xticklabels(workloads, rotation=15)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
