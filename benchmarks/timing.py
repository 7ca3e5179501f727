"""Interleaved timing: every peer steps once per round, so machine drift hits all of them alike."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class Samples:
    """Step times of one system, index-aligned by round with every other system of the run."""

    times: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def worst(self) -> float:
        return max(self.times)


def timed(step: Callable[[], object]) -> float:
    """Seconds one call of `step` takes (wall clock: the peers use several threads)."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def interleave(
    steps: dict[str, Callable[[int], object]],
    rounds: int,
    first_round: int = 0,
    lead_seconds: float = 0.0,
) -> dict[str, Samples]:
    """Run `rounds` rounds; in each, every peer does one step (`step(round_index)`).

    The order rotates from round to round: whoever runs right after another peer pays for the
    threads that peer leaves spinning, and the rotation spreads that cost evenly. Where a peer
    leaves them spinning far longer than a step (ORT's default sessions: ORTModule's eager peer
    ran 6.9-7.8 ms a step right after it, 2.8-3.0 alone), `lead_seconds` has every peer run its
    own steps before the timed one, untimed, for about that long (at least one), so that the
    timed step follows its own, as in a loop of that peer alone.
    """
    names = list(steps)
    samples = {name: Samples() for name in names}
    for index in range(first_round, first_round + rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            if lead_seconds:
                typical = samples[name].median if samples[name].times else lead_seconds
                for earlier in range(index - max(1, math.ceil(lead_seconds / typical)), index):
                    steps[name](earlier)
            samples[name].times.append(timed(functools.partial(steps[name], index)))
    return samples


def paired_ratio(times: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of (this peer's step / the baseline's step in the same round).

    Pairing by round cancels drift that is slower than a round, which the ratio of two medians
    taken over the whole run would not.
    """
    return statistics.median(t / b for t, b in zip(times, baseline, strict=True))
