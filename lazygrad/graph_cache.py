"""In-memory LRU of built graphs, owned by one lazy model; counts its evictions."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import cachetools


class GraphCache(cachetools.LRUCache):
    """`cachetools.LRUCache` that reports each eviction (the documented way: override popitem)."""

    def __init__(self, maxsize: int, on_evict: Callable[[Hashable, Any], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self) -> tuple[Hashable, Any]:
        key, value = super().popitem()
        self._on_evict(key, value)
        return key, value
