"""``ProbedPrefixCache``: the replica's prefix cache with what the tests read of it.

The runtime ``PrefixCachingBlocks`` answers only what the scheduler asks. The tests also ask what
an allocation would find (``cached_prefix``, ``fits``: no change), the reference counts and names
behind the tables (``refs``, ``named_blocks``), and how many positions admissions asked about and
found cached (``counters``). An engine builds its block space itself: ``probe_engine_caches``
makes the engines built after it (in one test) use this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest

from tierserve.records import RequestId
from tierserve.replica import kv_pool
from tierserve.replica.block_space import Allocation
from tierserve.replica.prefix_cache import PrefixCachingBlocks


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """Totals since start: positions asked about at admission, positions found cached."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class ProbedPrefixCache(PrefixCachingBlocks):
    """``PrefixCachingBlocks`` that also answers the tests' questions (see the module docstring)."""

    def __init__(self, block_size: int, ids: Iterable[int], root: int = 0) -> None:
        super().__init__(block_size, ids, root)
        self._queried = 0
        self._hits = 0

    @property
    def counters(self) -> CacheCounters:
        return CacheCounters(self._queried, self._hits)

    def allocate(self, id: RequestId, tokens: Sequence[int], reuse: bool = True,
                 partition: str | None = None) -> Allocation:
        alloc = super().allocate(id, tokens, reuse, partition)
        self._queried += len(tokens)
        self._hits += alloc.cached_tokens
        return alloc

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Positions of ``tokens`` that ``allocate`` would find cached (no change)."""
        return len(self._matches(tokens)[0]) * self.block_size

    def fits(self, tokens: Sequence[int]) -> bool:
        """Whether ``allocate`` would succeed for ``tokens`` now (no change)."""
        hits = self._matches(tokens)[0]
        need = -(-len(tokens) // self.block_size) - len(hits)
        return need <= self.free_blocks - sum(1 for b in hits if b in self._evictable)

    def refs(self) -> dict[int, int]:
        """Block -> references, for every block some table holds."""
        return dict(self._refs)

    def named_blocks(self) -> dict[int, int]:
        """Block -> hash, for every named block (used or evictable)."""
        return dict(self._name_of)


def probe_engine_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from now on in this test hold a ``ProbedPrefixCache`` (the KV pool builds
    the prefix cache of ``Engine.scheduler.blocks``)."""
    monkeypatch.setattr(kv_pool, "PrefixCachingBlocks", ProbedPrefixCache)
