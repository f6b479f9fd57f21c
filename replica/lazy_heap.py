"""A binary heap with handles and lazy deletion: push O(log n), remove by handle O(1).

``remove`` only marks the entry dead; dead entries are skipped when they reach the top, and the
heap is rebuilt without them once they outnumber the live ones, so memory stays O(live).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True, slots=True)
class Handle(Generic[T]):
    """One heap entry; compare by ``key`` only (keys must be unique, e.g. end with a sequence no.)."""

    key: Any
    item: T = field(compare=False)
    alive: bool = field(default=True, compare=False)


class LazyHeap(Generic[T]):
    """Min-heap on ``key``: the smallest key is the head."""

    __slots__ = ("_dead", "_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[Handle[T]] = []
        self._live = 0
        self._dead = 0

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def push(self, key: Any, item: T) -> Handle[T]:
        """Insert ``item`` under ``key``; keep the handle to remove it later."""
        h = Handle(key, item)
        heapq.heappush(self._heap, h)
        self._live += 1
        return h

    def remove(self, handle: Handle[T]) -> bool:
        """Mark ``handle`` dead in O(1); False when it was already gone."""
        if not handle.alive:
            return False
        handle.alive = False
        self._live -= 1
        self._dead += 1
        if self._dead > 64 and self._dead > self._live:
            self._heap = [h for h in self._heap if h.alive]
            heapq.heapify(self._heap)
            self._dead = 0
        return True

    def peek(self) -> T | None:
        """The head's item, or None when empty."""
        heap = self._heap
        while heap and not heap[0].alive:
            heapq.heappop(heap)
            self._dead -= 1
        return heap[0].item if heap else None

    def pop(self) -> T:
        """Remove and return the head's item; IndexError when empty."""
        if self.peek() is None:
            raise IndexError("pop from an empty LazyHeap")
        h = heapq.heappop(self._heap)
        h.alive = False
        self._live -= 1
        return h.item

    def items(self) -> list[T]:
        """Every live item, in no particular order."""
        return [h.item for h in self._heap if h.alive]
