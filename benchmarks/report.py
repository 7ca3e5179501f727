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
    peak_mib: float | None = None  # fresh process: peak RSS over steady steps above resting
    exports: int | None = None
    builds: int | None = None
    hit_rate: float | None = None


HEADER = (
    "workload", "peer", "median step ms", "x eager", "steps/s", "first step s", "peak MiB",
    "exports", "builds", "hit rate",
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
        _cell(row.peak_mib, ".0f"),
        _cell(row.exports, "d"),
        _cell(row.builds, "d"),
        _cell(row.hit_rate, ".1%"),
    ]


def table(rows: Sequence[Row]) -> str:
    """A markdown table, padded so it also reads well in a terminal."""
    lines = [list(HEADER), *(cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]

    def render(line: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


def markdown(rows: Sequence[Row], notes: Sequence[str]) -> str:
    """The whole results file: the table, then how each figure was measured."""
    return "\n".join(
        ["# lazygrad benchmarks", "", table(rows), "", *(f"- {note}" for note in notes), ""]
    )


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
