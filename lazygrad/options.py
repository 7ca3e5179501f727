"""How a lazy module runs: the options given once, to `lazygrad.lazy`."""

from __future__ import annotations

import dataclasses
import os

POLICIES = ("predict", "all", "recompute")
# Backward segments at most, by default; fewer where the stash is small (each frees at least
# `segment.STASH_PER_SEGMENT`). Measured (benchmarks/results/memory.md, "Segmented backward"):
# 16 against 2 took what a backward adds from 106 to 46 MiB on the 8-layer BERT-shaped model and
# from 223 to 57 on a ResNet-18 (eager: 125, 35), the ResNet's whole-process peak from 862 to
# 757 MiB. Step time within the runs' spread: BERT-shaped `all three` 0.985x / 0.971x eager
# against 0.958x / 0.952x in two `benchmarks.steady --ablate` runs, 0.995x against 1.032x in a
# third; ResNet-18 1.618x against 1.609x (a segment is one ORT run more).
SEGMENTS = 16


@dataclasses.dataclass(frozen=True)
class Options:
    """How a lazy module runs; given once, to `lazygrad.lazy`."""

    policy: str = "predict"
    cache_size: int = 64
    strict: bool = False
    segments: int = SEGMENTS
    arena: bool = False  # ORT's CPU memory arena (session.py: faster, more memory)
    recompute_layers: bool = False  # keep each repeated layer's input only (capture/layers.py)
    # Block a step until its graphs are built, instead of running it in eager PyTorch while they
    # build in the background. Default: the environment's LAZYGRAD_WAIT_FOR_BUILDS (1: wait).
    wait_for_builds: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("LAZYGRAD_WAIT_FOR_BUILDS", "0") not in ("", "0")
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"lazygrad: policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.arena, bool):
            raise ValueError(f"lazygrad: arena must be True or False, got {self.arena!r}")
        if not isinstance(self.recompute_layers, bool):
            raise ValueError("lazygrad: recompute_layers must be True or False, got "
                             f"{self.recompute_layers!r}")
        if not isinstance(self.segments, int) or self.segments < 1:
            raise ValueError(f"lazygrad: segments must be a positive int, got {self.segments!r}")
        if not isinstance(self.cache_size, int) or self.cache_size < 1:
            raise ValueError(
                f"lazygrad: cache_size must be a positive int, got {self.cache_size!r}"
            )
