"""How a lazy module runs: the options given once, to `lazygrad.lazy`."""

from __future__ import annotations

import dataclasses
import os

POLICIES = ("predict", "all", "recompute")
# Backward segments by default, measured on the 8-layer model (benchmarks/results/memory.md,
# "Segmented backward"): 2 freed the most of the steady step's peak measured (-217 MiB) at the
# same step time (0.96x); 4 made the step 1.10x slower.
SEGMENTS = 2


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
