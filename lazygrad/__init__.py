"""lazygrad: PyTorch training through ONNX Runtime with a backward built lazily per grad mask."""

from lazygrad.api import clear_cache, lazy, reset_stats, stats, wait_for_builds
from lazygrad.errors import FallbackWarning, GraphBreakWarning, LazygradError
from lazygrad.options import Options
from lazygrad.session import GraphRunError
from lazygrad.stats import EntryStats, Stats

__all__ = [
    "EntryStats",
    "FallbackWarning",
    "GraphBreakWarning",
    "GraphRunError",
    "LazygradError",
    "Options",
    "Stats",
    "clear_cache",
    "lazy",
    "reset_stats",
    "stats",
    "wait_for_builds",
]
