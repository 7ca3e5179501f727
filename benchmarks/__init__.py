"""Benchmarks of lazygrad against the systems a user would pick instead (`python -m benchmarks`).

Every figure is a ratio against PyTorch eager measured in the same run, interleaved step by step,
because the machines this runs on are shared and their speed drifts by several times within a
minute. Memory and first-step times come from a fresh process per configuration, so that one
configuration's caches and allocator arenas do not show up in another's numbers.
"""
