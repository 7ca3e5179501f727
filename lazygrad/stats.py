"""Cache statistics as plain data: how a user sees whether the lazy backward pays off."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EntryStats:
    """One cached backward graph."""

    mask: tuple[bool, ...]
    forward: str = ""  # which forward graph (input signature) it belongs to: a content hash prefix
    hits: int = 0
    build_seconds: float = 0.0
    from_disk: bool = False


@dataclasses.dataclass
class Stats:
    """Counters of one lazy model since it was made or since `reset_stats`.

    hits / misses: backward lookups that found / did not find a graph for their (signature, mask).
    builds: backward graphs built (a miss builds one; so does planning the stash of a new
    signature under the "predict" and "all" policies, for the mask of all outputs).
    fallbacks: signatures that could not be exported or differentiated and run in eager PyTorch.
    recomputes: backward steps that had to recompute intermediates the forward did not stash.
    disk_hits: graphs loaded from the on-disk cache instead of being built.
    evictions: graphs dropped by the LRU cache (`cache_size`).
    exports: forward graphs exported (one per input signature).
    """

    hits: int = 0
    misses: int = 0
    builds: int = 0
    fallbacks: int = 0
    recomputes: int = 0
    disk_hits: int = 0
    evictions: int = 0
    exports: int = 0
    entries: list[EntryStats] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def __str__(self) -> str:
        counters = (
            f"hits={self.hits} misses={self.misses} hit_rate={self.hit_rate:.1%} "
            f"builds={self.builds} exports={self.exports} fallbacks={self.fallbacks} "
            f"recomputes={self.recomputes} disk_hits={self.disk_hits} "
            f"evictions={self.evictions}"
        )
        rows = [f"{'forward':<10}{'mask':<24}{'hits':>8}{'build ms':>12}{'source':>8}"]
        for entry in self.entries:
            mask = "".join("1" if bit else "0" for bit in entry.mask)
            source = "disk" if entry.from_disk else "built"
            rows.append(
                f"{entry.forward:<10}{mask:<24}{entry.hits:>8}"
                f"{entry.build_seconds * 1e3:>12.1f}{source:>8}"
            )
        return "\n".join([counters, *rows])
