"""The prefix-caching block space: sharing, reference counts, eviction, and the scheduler over it.

Unit tests pin ``PrefixCachingBlocks``' contract; the property test replays random traffic whose
prompts share prefixes (a few "system prompts", user suffixes of their own), with preemptions and
aborts, through ``Sim`` (harness.py) with the prefix cache: every step it checks that a block sits
in two tables only when it is a named block at the same position of both, that reference counts
equal the tables holding each block, that free + cached + used = total, that no shared block is
written, and that every cached position an admission starts after holds exactly that request's
token. Every request's tokens are the fake model's, as without the cache.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.replica.fake_model import FakeModel
from tests.replica.prefix_probe import ProbedPrefixCache
from tests.replica.scheduler.harness import Sim, blocks_for, caps
from tierserve.replica.block_space import NoCapacity
from tierserve.replica.prefill_policy import Chunked, PrefillPolicy, WholePrompt
from tierserve.replica.prefix_cache import block_hashes, model_key, partition_root
from tierserve.replica.scheduler import QueueFull, Request, SchedPolicy, Scheduler

B = 4


def cache(n: int = 16, root: int = 1) -> ProbedPrefixCache:
    """The replica's prefix cache (``PrefixCachingBlocks``), with the probes the tests read."""
    return ProbedPrefixCache(B, range(n), root)


def filled(c: ProbedPrefixCache, rid: int, tokens: list[int]) -> int:
    """Allocate ``tokens`` for ``rid`` and mark them all computed; returns the cached count."""
    got = c.allocate(rid, tokens).cached_tokens
    c.commit(rid, tokens, len(tokens))
    return got


def test_a_shared_prefix_is_found_and_shared() -> None:
    c = cache()
    system = list(range(100, 112))  # three full blocks
    assert filled(c, 0, [*system, 1, 2]) == 0
    assert c.allocate(1, [*system, 7, 8, 9]).cached_tokens == 12
    assert c.block_table(1)[:3] == c.block_table(0)[:3]
    assert c.block_table(1)[3] not in c.block_table(0)
    assert all(c.refs()[b] == 2 for b in c.block_table(0)[:3])
    assert c.free_blocks == 16 - 4 - 1


def test_partitions_never_share_blocks() -> None:
    """A request finds only what its own partition cached (a tenant, a ``cache_salt``): another
    partition's identical prompt is computed again, in blocks of its own, and its
    ``cached_tokens`` says 0 (the side channel a shared cache would open)."""
    c = cache(32)
    system = list(range(100, 112))  # three full blocks

    def put(rid: int, partition: str | None) -> int:
        tokens = [*system, rid]
        got = c.allocate(rid, tokens, partition=partition).cached_tokens
        c.commit(rid, tokens, len(tokens))
        return got

    assert put(0, "tenant=a") == 0
    assert put(1, "tenant=b") == 0  # b cannot see a's prompt
    assert put(2, None) == 0  # nor can the shared partition
    assert put(3, "tenant=a") == 12  # a finds its own
    assert put(4, "tenant=b") == 12 and put(5, None) == 12
    tables = [c.block_table(r)[:3] for r in (0, 1, 2)]
    assert len({b for t in tables for b in t}) == 9  # three partitions, three copies
    assert c.block_table(3)[:3] == tables[0]
    # The router's names of a partition's blocks are the replica's (same root).
    assert block_hashes(system, B, partition_root(1, "tenant=a")) != block_hashes(system, B, 1)
    assert partition_root(1, None) == 1


def test_the_block_of_the_last_position_is_never_taken_from_the_cache() -> None:
    """Its position is computed again (its logits are needed) and a shared block is never
    written: an identical prompt of whole blocks finds all but its last block."""
    c = cache()
    prompt = list(range(8))  # two full blocks
    filled(c, 0, prompt)
    assert c.allocate(1, prompt).cached_tokens == 4
    assert c.block_table(1)[0] == c.block_table(0)[0]
    assert c.block_table(1)[1] != c.block_table(0)[1]
    assert c.cached_prefix([*prompt, 9]) == 8


def test_released_blocks_stay_cached_until_their_room_is_needed() -> None:
    c = cache(n=6)
    a, b = list(range(8)), list(range(50, 58))
    filled(c, 0, [*a, 1])
    c.release(0)
    assert c.free_blocks == 6 and c.cached_blocks == 2  # 2 named, 1 unnamed back to free
    filled(c, 1, [*b, 2])
    c.release(1)
    assert c.cached_blocks == 4
    # Use a's blocks again (most recently used now), then need room: b's go first (LRU).
    assert c.allocate(2, [*a, 3]).cached_tokens == 8
    c.release(2)
    assert c.allocate(3, list(range(200, 216))).cached_tokens == 0  # 4 blocks: 2 free + 2 evicted
    assert c.cached_prefix([*a, 4]) == 8 and c.cached_prefix([*b, 4]) == 0


def test_allocation_is_all_or_nothing_and_counts_an_idle_hit_once() -> None:
    c = cache(n=4)
    prefix = list(range(8))
    filled(c, 0, [*prefix, 1])
    c.release(0)  # 2 named blocks evictable, 2 free
    before = (c.free_blocks, c.cached_blocks, c.refs())
    # 2 hits + 3 fresh > the 2 truly free: refused, and nothing changed.
    with pytest.raises(NoCapacity):
        c.allocate(1, [*prefix, *range(20, 29)])
    assert (c.free_blocks, c.cached_blocks, c.refs()) == before
    assert not c.fits([*prefix, *range(20, 29)]) and c.fits([*prefix, *range(20, 25)])
    assert c.allocate(1, [*prefix, *range(20, 25)]).cached_tokens == 8


def test_two_copies_of_one_block_keep_one_name() -> None:
    """Two requests that computed the same block side by side: the first named keeps the name;
    the other copy stays private and is free (not cached) once released."""
    c = cache()
    p = list(range(9))
    c.allocate(0, p)
    c.allocate(1, p)  # nothing cached yet
    c.commit(0, p, 9)
    c.commit(1, p, 9)
    named = c.named_blocks()
    assert set(named) == set(c.block_table(0)[:2])
    c.release(1)
    assert c.cached_blocks == 0 and c.free_blocks == 16 - 3


def test_names_depend_on_the_model_and_the_whole_prefix() -> None:
    toks = list(range(12))
    assert block_hashes(toks, B, model_key("m", "float32", 4)) != block_hashes(
        toks, B, model_key("n", "float32", 4))
    same_block = [9, 9, 9, 9]
    a = block_hashes([*range(4), *same_block], B, 1)
    b = block_hashes([*range(1, 5), *same_block], B, 1)
    assert a[1] != b[1]  # same tokens in block 1, different parents
    other_model = cache(root=2)
    filled(other_model, 0, [*toks, 1])
    assert cache(root=1).cached_prefix([*toks, 1]) == 0
    assert block_hashes(toks, B, 1, limit=2) == block_hashes(toks, B, 1)[:2]
    assert block_hashes(toks, B, 1, parent=a[0], start=1)[0] == block_hashes(toks, B, 1)[1]


def test_names_are_the_same_in_another_process() -> None:
    """The ingress names a prompt's blocks for the router in its own process."""
    code = ("from tierserve.replica.prefix_cache import block_hashes, model_key, partition_root; "
            "print(block_hashes(list(range(40)), 16, model_key('m', 'auto', 16)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_hashes(list(range(40)), 16, model_key("m", "auto", 16)))


def test_a_preempted_request_finds_its_own_prefix_again() -> None:
    c = cache()
    toks = list(range(11))
    filled(c, 0, toks)
    c.release(0)  # preempted: references gone, content kept
    assert c.allocate(0, toks).cached_tokens == 8


def test_the_scheduler_charges_only_what_is_not_cached() -> None:
    cfg = caps(max_seqs=4, max_batch_tokens=6, max_model_len=64)
    s = Scheduler(cfg, cache(n=32), Chunked(6))
    model = FakeModel(s)
    system = list(range(100, 116))  # 4 blocks
    first = s.add(Request([*system, 1, 2], 1))
    while s.has_unfinished():
        model.step()
    assert s.cached_tokens(first) is None  # finished: forgotten
    rid = s.add(Request([*system, 3, 4, 5], 2))
    plan = s.schedule()
    (chunk,) = plan.prefill
    assert (chunk.id, chunk.start, chunk.len, chunk.last) == (rid, 16, 3, True)
    assert plan.num_tokens == 3 and s.cached_tokens(rid) == 16


def test_committed_blocks_count_a_shared_prefix_once() -> None:
    cfg = caps(max_seqs=4, max_batch_tokens=64, max_model_len=64)
    blocks = cache(n=32)
    s = Scheduler(cfg, blocks, Chunked(64))
    model = FakeModel(s)
    system = list(range(100, 116))  # 4 blocks
    first = s.add(Request([*system, 1], 3))  # 17 + 3 -> 5 blocks at full length
    model.step()  # its prefill: the system prompt's blocks are named from now on
    second = s.add(Request([*system, 2], 3))
    model.step()  # admitted on the 4 cached blocks, one of its own
    assert s.cached_tokens(second) == 16
    # Referenced: 4 shared + 1 + 1; growth: none (position 20 still fits block 5 of each)...
    tables = [len(blocks.block_table(r)) for r in (first, second)]
    assert tables == [5, 5]
    # ...so 6 blocks, where the two requests at their full length alone would count 10.
    assert s.committed_blocks() == 6
    waiting = s.add(Request([*system, 3], 3))  # not admitted yet: counted at its full length
    assert s.cached_tokens(waiting) is None
    assert s.committed_blocks() == 6 + 5


# ----------------------------------------------------------------------------- random traffic


@dataclass
class Workload:
    block_size: int
    total_blocks: int
    policy: PrefillPolicy
    max_seqs: int
    budget: int
    ctx: int
    requests: list[tuple[int, Request]]
    aborts: list[tuple[int, int, bool]]


@st.composite
def shared_prefix_workloads(draw: st.DrawFn) -> Workload:
    bt = draw(st.integers(1, 4))
    ctx = draw(st.integers(16, 40))
    systems = draw(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=ctx // 2),
                            min_size=1, max_size=3))
    raw = draw(st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, len(systems) - 1),
                  st.lists(st.integers(0, 50), min_size=0, max_size=6), st.integers(1, 10),
                  st.integers(-2, 3)),
        min_size=2, max_size=16))
    requests = []
    for t, k, suffix, mt, prio in raw:
        prompt = (systems[k] + suffix)[: ctx - 1]
        requests.append((t, Request(prompt, mt, prio)))
    chunk = draw(st.one_of(st.none(), st.integers(1, 8)))
    policy: PrefillPolicy = WholePrompt() if chunk is None else Chunked(chunk)
    budget = ctx + 8 if chunk is None else draw(st.integers(2, 24))
    need = max(blocks_for(min(len(r.prompt) + r.max_tokens, ctx), bt) for _, r in requests)
    aborts = draw(st.lists(st.tuples(st.integers(0, 16), st.integers(0, len(requests) - 1),
                                     st.booleans()), max_size=4))
    return Workload(bt, need + draw(st.integers(0, need)), policy, draw(st.integers(1, 6)),
                    budget, ctx, requests, aborts)


def play(w: Workload, prefix_cache: bool) -> Sim:
    cfg = caps(max_seqs=w.max_seqs, max_batch_tokens=w.budget, max_waiting=100,
               policy=SchedPolicy.PRIORITY, aging_steps=2, max_model_len=w.ctx)
    sim = Sim(cfg, w.total_blocks, w.block_size, w.policy, prefix_cache=prefix_cache)
    rids: dict[int, int] = {}
    horizon = max([t for t, _ in w.requests] + [t for t, _, _ in w.aborts]) + 1
    for t in range(horizon):
        for i, (arrival, req) in enumerate(w.requests):
            if arrival == t:
                with contextlib.suppress(QueueFull):
                    rids[i] = sim.add(req)
        mid = []
        for step, i, between in w.aborts:
            if step == t and i in rids:
                if between:
                    mid.append(rids[i])
                else:
                    sim.abort(rids[i])
        sim.step(abort_mid=mid)
    sim.run(max_steps=20_000)
    return sim


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_shared_prefix_traffic_keeps_every_invariant_and_every_answer(w: Workload) -> None:
    cached = play(w, prefix_cache=True)
    cached.check_done()  # every answer is the fake model's, every block back
    plain = play(w, prefix_cache=False)
    plain.check_done()
    done = set(cached.reasons) & set(plain.reasons)  # (aborts may land at other moments)
    assert {r: cached.tokens[r] for r in done} == {r: plain.tokens[r] for r in done}
    hit = any(c.start > 0 and c.start % w.block_size == 0 and not plan.decode
              for plan in cached.plans for c in plan.prefill)
    event(f"a prefix hit: {hit}")
    event(f"preempted: {cached.preemptions > 0}")
    event(f"aborted: {bool(cached.abort_kinds)}")


def test_reuse_false_takes_fresh_blocks_and_leaves_the_cached_ones_alone() -> None:
    c = cache()
    system = list(range(100, 112))
    filled(c, 0, [*system, 1])
    assert c.allocate(1, [*system, 2], reuse=False).cached_tokens == 0
    assert not set(c.block_table(1)) & set(c.block_table(0))
    c.commit(1, [*system, 2], 13)  # same content, named first by request 0: stays private
    c.release(1)
    assert c.cached_prefix([*system, 3]) == 12 and c.free_blocks == 16 - 4


def test_block_names_are_blake2b_over_little_endian_token_words() -> None:
    """The names are a fixed function of the tokens (the ingress and every replica, on any
    machine, must agree): BLAKE2b-128 of the parent's 16 little-endian bytes, then each token id
    as 4 little-endian bytes."""
    import hashlib

    tokens = [1, 70000, 3, 4, 2**31 + 5, 6, 7, 8, 9]
    prev = 99
    want = []
    for i in range(2):
        h = hashlib.blake2b(prev.to_bytes(16, "little"), digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[4 * i : 4 * i + 4]))
        prev = int.from_bytes(h.digest(), "little")
        want.append(prev)
    assert block_hashes(tokens, 4, 99) == want
    assert block_hashes(tokens, 4, 99, parent=want[0], start=1) == want[1:]
