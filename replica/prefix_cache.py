"""Prefix caching: a ``BlockSpace`` whose full blocks are shared between requests by content.

A full block is named by a hash chain: block ``i``'s hash covers its parent's hash and its own
``block_size`` token ids, and the first block's parent is a key of the model (so two models,
dtypes or block sizes never share a name). Two requests whose prompts begin with the same
blocks therefore name them alike, and the second finds them computed.

- ``allocate`` takes the longest run of the request's leading full blocks that are cached
  (sharing them: reference counts), then fresh blocks for the rest, all or nothing; it reports
  the cached positions as ``Allocation.cached_tokens``. The block holding the last position of
  the tokens is never taken from the cache: the scheduler computes that position (its logits are
  needed), and a shared block is never written.
- ``commit`` names the blocks a request has filled and computed (the scheduler calls it after
  each step), so a request sharing a system prompt with one still running already hits.
- ``release`` drops the request's references. A named block whose last user is gone stays
  cached, *evictable*, until its room is needed (least recently used first); an unnamed one is
  free at once. A preempted request's blocks lose their references, not their content: its
  recompute usually hits its own prefix.
- ``free_blocks`` counts free and evictable blocks (what admission may use); ``cached_blocks``
  the evictable ones.

Hashes are BLAKE2b over the token ids: a client cannot craft a collision to read another
request's cache. ``block_hashes`` is torch-free and deterministic across processes, so the
ingress computes the same names for the router.
"""

from __future__ import annotations

import array
import hashlib
import heapq
import itertools
import json
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tierserve.arith import ceil_div
from tierserve.records import RequestId
from tierserve.replica.block_space import Allocation, NoCapacity

_DIGEST = 16
_BIG_ENDIAN = sys.byteorder == "big"


def model_key(*parts: object) -> int:
    """The root of every hash chain for one model: a digest of what makes K/V differ."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=_DIGEST)
    return int.from_bytes(h.digest(), "little")


def partition_root(root: int, partition: str | None) -> int:
    """The root of the hash chains of one prefix-cache partition (``partition`` None: the
    shared one, ``root`` itself): blocks of two partitions never share a name, so a request
    never finds, nor learns from ``cached_tokens`` about, another partition's prompts."""
    return root if partition is None else model_key(root, "partition", partition)


def adapter_partition(partition: str | None, adapter: str | None) -> str | None:
    """The prefix-cache partition of a request of cache partition ``partition`` run under the
    LoRA adapter ``adapter`` (its key, ``LoRARequest.key``: name and id, so a name loaded again
    from other weights never finds the old copy's blocks; None: the base model, ``partition``
    itself). K/V computed under an
    adapter differ from the base's and another adapter's, so each adapter has partitions of its
    own: ``lora=`` and a JSON pair, which no partition the ingress makes starts with
    (``tierserve.cluster.tiers.cache_partition``: ``tenant=``, ``salt=``), so a client's salt
    cannot name an adapter's blocks."""
    if adapter is None:
        return partition
    return "lora=" + json.dumps([adapter, partition], ensure_ascii=True)


def _chain(prev: int, block: Sequence[int]) -> int:
    h = hashlib.blake2b(prev.to_bytes(_DIGEST, "little"), digest_size=_DIGEST)
    ids = array.array("I", block)  # token ids as 4-byte little-endian words, on any machine
    if _BIG_ENDIAN:
        ids.byteswap()
    h.update(ids.tobytes())
    return int.from_bytes(h.digest(), "little")


def iter_block_hashes(tokens: Sequence[int], block_size: int, root: int,
                      parent: int | None = None, start: int = 0) -> Iterator[int]:
    """Hashes of the full blocks of ``tokens`` from block ``start`` on, computed lazily
    (``parent``: the hash of block ``start - 1``; None from the first block)."""
    prev = root if parent is None else parent
    for i in range(start, len(tokens) // block_size):
        prev = _chain(prev, tokens[i * block_size : (i + 1) * block_size])
        yield prev


def block_hashes(tokens: Sequence[int], block_size: int, root: int, limit: int | None = None,
                 parent: int | None = None, start: int = 0) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from block ``start`` on, at most ``limit``."""
    return list(itertools.islice(iter_block_hashes(tokens, block_size, root, parent, start),
                                 limit))


@dataclass(slots=True)
class _Table:
    blocks: list[int] = field(default_factory=list)
    named: int = 0  # leading blocks that carry a name (cached or committed by this request)
    last_hash: int | None = None  # the name of block ``named - 1``
    root: int = 0  # the root of its partition's hash chains


class PrefixCachingBlocks:
    """The prefix-caching ``BlockSpace`` (see the module docstring). ``root``: ``model_key(...)``
    of the model whose K/V the blocks hold."""

    def __init__(self, block_size: int, ids: Iterable[int], root: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self._root = root
        self._free = sorted(set(ids))  # never named, or evicted: a heap, lowest ids first
        self._total = len(self._free)
        self._refs: dict[int, int] = {}  # block -> references (tables holding it), for used blocks
        self._name_of: dict[int, int] = {}  # block -> its hash, for named blocks
        self._by_name: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unreferenced; LRU first
        self._tables: dict[RequestId, _Table] = {}

    # ------------------------------------------------------------------ BlockSpace

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def total_blocks(self) -> int:
        return self._total

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Unreferenced blocks kept for their content (evictable)."""
        return len(self._evictable)

    def allocate(self, id: RequestId, tokens: Sequence[int], reuse: bool = True,
                 partition: str | None = None) -> Allocation:
        if id in self._tables:
            raise ValueError(f"request {id} already holds blocks")
        root = partition_root(self._root, partition)
        hits, names = self._matches(tokens, root) if reuse else ([], [])
        need = ceil_div(len(tokens), self._block_size) - len(hits)
        # Hit blocks that sit unreferenced would be counted twice: as a hit and as room.
        idle_hits = sum(1 for b in hits if b in self._evictable)
        if need > self.free_blocks - idle_hits:
            raise NoCapacity
        for b in hits:
            self._ref(b)
        table = _Table(list(hits), len(hits), names[-1] if names else None, root)
        table.blocks.extend(self._take(need))
        self._tables[id] = table
        return Allocation(len(hits) * self._block_size)

    def append_slot(self, id: RequestId, total: int) -> None:
        table = self._tables.setdefault(id, _Table(root=self._root))
        need = ceil_div(total, self._block_size) - len(table.blocks)
        if need <= 0:
            return
        if need > self.free_blocks:
            raise NoCapacity
        table.blocks.extend(self._take(need))

    def commit(self, id: RequestId, tokens: Sequence[int], computed: int) -> None:
        """Name ``id``'s blocks that its first ``computed`` positions fill (their K/V are
        written), so later requests with the same prefix can share them."""
        table = self._tables.get(id)
        if table is None:
            return
        full = min(computed // self._block_size, len(table.blocks))
        if full <= table.named:
            return
        names = block_hashes(tokens, self._block_size, table.root, limit=full - table.named,
                             parent=table.last_hash, start=table.named)
        for i, h in enumerate(names, start=table.named):
            b = table.blocks[i]
            if h not in self._by_name and b not in self._name_of:
                self._by_name[h] = b
                self._name_of[b] = h
            # else: another request named the same content first; this copy stays private.
        table.named = full
        table.last_hash = names[-1]

    def release(self, id: RequestId) -> None:
        table = self._tables.pop(id, None)
        if table is None:
            return
        for b in table.blocks:
            refs = self._refs[b] - 1
            if refs:
                self._refs[b] = refs
                continue
            del self._refs[b]
            if b in self._name_of:
                self._evictable[b] = None  # most recently used last
            else:
                heapq.heappush(self._free, b)

    def block_table(self, id: RequestId) -> Sequence[int]:
        table = self._tables.get(id)
        return table.blocks if table is not None else ()

    # ------------------------------------------------------------------ internals

    def _matches(self, tokens: Sequence[int], root: int | None = None
                 ) -> tuple[list[int], list[int]]:
        """The cached blocks of ``tokens``' longest cached prefix (never the block of its last
        position) and their names, in the partition of ``root`` (None: the shared one)."""
        usable = (len(tokens) - 1) // self._block_size if tokens else 0
        hits: list[int] = []
        names: list[int] = []
        if not usable or not self._by_name:
            return hits, names
        chain = iter_block_hashes(tokens, self._block_size, self._root if root is None else root)
        for h in itertools.islice(chain, usable):
            b = self._by_name.get(h)
            if b is None:
                break
            hits.append(b)
            names.append(h)
        return hits, names

    def _ref(self, b: int) -> None:
        if b in self._evictable:
            del self._evictable[b]
        self._refs[b] = self._refs.get(b, 0) + 1

    def _take(self, n: int) -> list[int]:
        """``n`` unreferenced blocks: free ones first (lowest ids), then the least recently used
        cached ones, whose names are dropped."""
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_name[self._name_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out
