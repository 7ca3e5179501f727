"""Cache statistics as plain data: how a user sees whether the lazy backward pays off."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EntryStats:
    """One cached pair of graphs: a forward and the backward of one grad mask."""

    mask: tuple[bool, ...] | None  # None: an inference graph (no backward)
    forward: str = ""  # which input signature it serves: a short id
    hits: int = 0
    build_seconds: float = 0.0  # trace + export + check (0 when loaded from disk)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per stage
    from_disk: bool = False


@dataclasses.dataclass
class Stats:
    """Counters of one lazy model since it was made or since `reset_stats`.

    hits / misses: backward lookups that found / did not find the graphs of their
    (signature, mask); a miss builds them (or loads them from disk).
    builds: graph pairs captured, exported and checked; disk_hits: pairs loaded from disk.
    exports: input signatures that got graphs (one per signature, whatever its masks).
    eager_steps: calls run in eager PyTorch because their signature or mask had no graphs yet
    (the first step of each signature: its grad mask is known only at its backward).
    fallbacks: signatures that cannot run through ORT and run in eager PyTorch for good.
    breaks: signatures that cannot be captured whole and run in parts: the module's own forward
    in eager PyTorch, its submodules (`parts`) through ORT, each with statistics of its own.
    reasons: why, per fallback or break (one line each, the module's class first).
    step_seconds / ort_seconds: wall time of the model's forward and backward calls (from the
    call to its return, and from the first gradient reaching its outputs to the end of that
    backward), less the time a step blocked on a build (`wait_for_builds`, strict mode: that is
    `build_seconds`), and the part of it spent inside ONNX Runtime's runs; `ort_share` is their
    ratio. Counted for the module the user calls (not for its parts), eager steps included.
    recomputes: backward steps whose mask differed from the forward's plan, so the forward of
    the actual mask was rerun from the saved inputs and draws.
    evictions: pairs dropped by the LRU cache (`cache_size`).
    """

    hits: int = 0
    misses: int = 0
    builds: int = 0
    fallbacks: int = 0
    recomputes: int = 0
    disk_hits: int = 0
    evictions: int = 0
    exports: int = 0
    eager_steps: int = 0
    breaks: int = 0
    step_seconds: float = 0.0
    ort_seconds: float = 0.0
    reasons: list[str] = dataclasses.field(default_factory=list)
    entries: list[EntryStats] = dataclasses.field(default_factory=list)
    parts: dict[str, Stats] = dataclasses.field(default_factory=dict)  # by qualified name

    @property
    def ort_share(self) -> float:
        return self.ort_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def __str__(self) -> str:
        counters = (
            f"hits={self.hits} misses={self.misses} hit_rate={self.hit_rate:.1%} "
            f"builds={self.builds} exports={self.exports} eager_steps={self.eager_steps} "
            f"fallbacks={self.fallbacks} breaks={self.breaks} recomputes={self.recomputes} "
            f"disk_hits={self.disk_hits} evictions={self.evictions}"
        )
        if self.step_seconds:
            counters += (f"\ninside ONNX Runtime: {self.ort_share:.1%} of forward+backward "
                         f"({self.ort_seconds:.2f} s of {self.step_seconds:.2f} s)")
        rows = [f"{'forward':<10}{'mask':<24}{'hits':>8}{'build s':>10}{'source':>8}"]
        for entry in self.entries:
            mask = "inference" if entry.mask is None else "".join(
                "1" if bit else "0" for bit in entry.mask
            )
            source = "disk" if entry.from_disk else "built"
            rows.append(
                f"{entry.forward:<10}{mask:<24}{entry.hits:>8}"
                f"{entry.build_seconds:>10.2f}{source:>8}"
            )
        return "\n".join([counters, *rows, *self._parts_table()])

    def _parts_table(self) -> list[str]:
        """Per part (a submodule captured on its own after a break): what ran where, and why."""
        if not self.parts:
            return []
        width = max(len(name) for name in self.parts) + 2
        rows = ["", f"{'part':<{width}}{'graphs':>8}{'hits':>8}{'eager':>8}{'fallbacks':>11}"
                    f"{'breaks':>8}"]
        for name, part in self.parts.items():
            rows.append(f"{name:<{width}}{len(part.entries):>8}{part.hits:>8}"
                        f"{part.eager_steps:>8}{part.fallbacks:>11}{part.breaks:>8}")
        reasons = [f"  (whole model) {r}" for r in self.reasons] + [
            f"  {name}: {r}" for name, part in self.parts.items() for r in part.reasons
        ]
        return [*rows, "why:", *reasons] if reasons else rows
