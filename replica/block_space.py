"""The scheduler's only view of KV memory: block ids, never bytes (docs/scheduler.md §6)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tierserve.arith import ceil_div
from tierserve.records import RequestId


class NoCapacity(Exception):
    """Not enough free blocks; nothing was allocated."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate`` found: ``cached_tokens`` leading positions already computed (prefix hits)."""

    cached_tokens: int = 0


@runtime_checkable
class BlockSpace(Protocol):
    """Hands out KV block ids to requests. ``allocate`` and ``append_slot`` are all or nothing."""

    @property
    def block_size(self) -> int: ...
    @property
    def total_blocks(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    @property
    def cached_blocks(self) -> int:
        """Free blocks that keep cached content (counted in ``free_blocks``)."""
        ...

    def allocate(self, id: RequestId, tokens: Sequence[int], reuse: bool = True,
                 partition: str | None = None) -> Allocation:
        """Blocks for every position of ``tokens``; raises ``NoCapacity`` and allocates nothing.
        ``reuse`` False: take no cached block (every position will be computed).
        ``partition``: a prefix cache shares blocks only between requests of the same
        partition (None: the shared one)."""
        ...

    def append_slot(self, id: RequestId, total: int) -> None:
        """Grow ``id``'s table to hold ``total`` positions; raises ``NoCapacity``, changing nothing."""
        ...

    def commit(self, id: RequestId, tokens: Sequence[int], computed: int) -> None:
        """``id``'s first ``computed`` positions of ``tokens`` now have their K/V written (the
        scheduler calls it after every step; a prefix cache names the full blocks)."""
        ...

    def release(self, id: RequestId) -> None:
        """Give back every block of ``id`` (what it committed stays named, for a prefix cache)."""
        ...

    def block_table(self, id: RequestId) -> Sequence[int]:
        """``id``'s block ids in position order (empty when it holds none)."""
        ...


class FreeListBlocks:
    """The simplest BlockSpace: a free list that always hands out the lowest free ids first."""

    __slots__ = ("_block_size", "_free", "_tables", "_total")

    def __init__(self, block_size: int, ids: Iterable[int]) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self._free = sorted(set(ids))
        self._total = len(self._free)
        self._tables: dict[RequestId, list[int]] = {}

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def total_blocks(self) -> int:
        return self._total

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        return 0  # a free list keeps no content

    def _take(self, n: int) -> list[int]:
        free = self._free
        return [heapq.heappop(free) for _ in range(n)]

    def allocate(self, id: RequestId, tokens: Sequence[int], reuse: bool = True,
                 partition: str | None = None) -> Allocation:
        if id in self._tables:
            raise ValueError(f"request {id} already holds blocks")
        need = ceil_div(len(tokens), self._block_size)
        if need > len(self._free):
            raise NoCapacity
        self._tables[id] = self._take(need)
        return Allocation(0)

    def append_slot(self, id: RequestId, total: int) -> None:
        table = self._tables.setdefault(id, [])
        need = ceil_div(total, self._block_size) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            raise NoCapacity
        table.extend(self._take(need))

    def commit(self, id: RequestId, tokens: Sequence[int], computed: int) -> None:
        """Nothing to do: a free list keeps no content."""

    def release(self, id: RequestId) -> None:
        table = self._tables.pop(id, None)
        if table:
            free = self._free
            for b in table:
                heapq.heappush(free, b)

    def block_table(self, id: RequestId) -> Sequence[int]:
        return self._tables.get(id, ())
