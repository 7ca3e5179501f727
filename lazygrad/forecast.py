"""Which grad mask a forward should stash for: a forecast from the masks its backwards brought.

A forward in ORT stashes what one mask's backward reads; a backward that brings another mask
reruns the forward of its own pair (`step.py`), one forward more. Training loops change masks in
patterns: an auxiliary loss every k-th step, tasks taken in turn, one module called twice per
step for two heads. Planning for the last mask seen misses twice per cycle of such a pattern
(the step the other mask joins, and the step after it), so an auxiliary loss every 4th step
reran half the forwards. Here a cycle of 2 to `LONGEST_CYCLE` calls, once it has repeated, is
followed exactly. Otherwise the plan is the mask that most often followed the latest mask (the
latest itself if it is new): a run of one mask is planned for, a mask that joins on odd steps
costs one miss, not two, and a change for good (a new phase of training) costs one.

Calls are numbered in forward order and each backward's mask is recorded under its call's
number, so backwards that come in another order (two calls, then their backwards in reverse)
still line up with the forwards they belong to.
"""

from __future__ import annotations

import collections
import itertools

Mask = tuple[bool, ...]

LONGEST_CYCLE = 16  # calls; an auxiliary loss every 16th step is followed


class MaskForecast:
    """One signature's recent masks by call number; not thread-safe (the runtime's lock)."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self._masks: dict[int, Mask] = {}  # call number -> its backward's mask
        self._cycle: int | None = None  # in calls, once the masks have repeated with it
        self._follower: Mask | None = None  # the plan without a cycle; None: not worked out

    def next_call(self) -> int:
        """The number of a forward that is about to run."""
        return next(self._numbers)

    def record(self, call: int, mask: Mask) -> None:
        """Call `call`'s backward brought `mask`."""
        masks = self._masks
        masks[call] = mask
        if len(masks) > 2 * LONGEST_CYCLE:
            del masks[min(masks)]
        if self._cycle is None or not self._repeats(self._cycle):
            self._cycle = next(
                (c for c in range(2, LONGEST_CYCLE + 1) if self._repeats(c)), None)
        self._follower = None

    def plan(self, call: int) -> Mask | None:
        """The mask call `call`'s backward will most likely bring; None before any backward."""
        if self._cycle is not None:
            cycled = self._masks.get(call - self._cycle)
            if cycled is not None:
                return cycled
        if self._follower is None and self._masks:
            self._follower = self._most_likely_follower()
        return self._follower

    def _most_likely_follower(self) -> Mask:
        """The mask that most often came after the latest one (among as often, the more frequent
        overall, then the later), or the latest one itself if it is new."""
        masks = self._masks
        calls = sorted(masks)
        latest = masks[calls[-1]]
        followers = [masks[c + 1] for c in calls[:-1] if masks[c] == latest and c + 1 in masks]
        if not followers:
            return latest
        after, overall = collections.Counter(followers), collections.Counter(masks.values())
        return max(reversed(followers), key=lambda mask: (after[mask], overall[mask]))

    def _repeats(self, cycle: int) -> bool:
        """The last `cycle` calls recorded brought the masks of the `cycle` calls before them."""
        masks = self._masks
        latest = max(masks)
        return all(
            call in masks and call - cycle in masks and masks[call] == masks[call - cycle]
            for call in range(latest - cycle + 1, latest + 1)
        )
