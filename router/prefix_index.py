"""What the router believes each replica has cached: the prefix blocks it has sent there.

A replica's prefix cache names each full block of a prompt by a hash chain
(``tierserve.replica.prefix_cache``); the ingress computes the same names for every request
(``GenerateRequest.prefix_hashes``). The router records the names of every request it sends to
a replica and, for a new request, counts how many of its leading blocks it has sent there: the
blocks the request would probably find cached. Approximate by design (no round trip to the
replicas per request): a replica may have evicted a block the router still remembers, or hold
blocks that another router sent it.

Bounded: per replica, the most recently sent names up to a capacity (the replica's pool size
once it has reported, since it cannot cache more blocks than it has; ``default_capacity``
before), least recently used first out. Pure and Ray-free; not thread-safe (the router holds its
lock around every call).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PrefixIndex(Generic[K]):
    """Per replica, an LRU set of block names (see the module docstring)."""

    def __init__(self, default_capacity: int = 4096) -> None:
        if default_capacity <= 0:
            raise ValueError(f"default_capacity must be positive, got {default_capacity}")
        self.default_capacity = default_capacity
        self._names: dict[K, OrderedDict[int, None]] = {}
        self._capacity: dict[K, int] = {}

    def capacity(self, replica: K) -> int:
        return self._capacity.get(replica, self.default_capacity)

    def set_capacity(self, replica: K, blocks: int) -> None:
        """Remember at most ``blocks`` names for ``replica`` (its pool size)."""
        if blocks <= 0:
            return
        self._capacity[replica] = blocks
        self._trim(replica)

    def match(self, replica: K, names: Sequence[int], limit: int | None = None) -> int:
        """How many leading ``names`` (at most ``limit``) were sent to ``replica``: a chain is
        cached from its start, so the count stops at the first name not sent."""
        known = self._names.get(replica)
        if not known:
            return 0
        hits = 0
        for name in names[:limit] if limit is not None else names:
            if name not in known:
                break
            hits += 1
        return hits

    def record(self, replica: K, names: Sequence[int]) -> None:
        """``replica`` was sent a request whose prompt has the blocks ``names``: they become its
        most recently used (the first block last: it is the one most shared)."""
        if not names:
            return
        known = self._names.setdefault(replica, OrderedDict())
        for name in reversed(names):
            known[name] = None
            known.move_to_end(name)
        self._trim(replica)

    def forget(self, keep: Iterable[K]) -> None:
        """Drop every replica not in ``keep``."""
        keep = set(keep)
        for replica in [r for r in self._names if r not in keep]:
            del self._names[replica]
        for replica in [r for r in self._capacity if r not in keep]:
            del self._capacity[replica]

    def size(self, replica: K) -> int:
        """Names remembered for ``replica``."""
        return len(self._names.get(replica, ()))

    def _trim(self, replica: K) -> None:
        known = self._names.get(replica)
        if known is None:
            return
        cap = self.capacity(replica)
        while len(known) > cap:
            known.popitem(last=False)
