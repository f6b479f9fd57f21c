"""Prefix affinity in the router: the index of names sent per replica, the ranking that weighs
cached prefixes against queues, room and balance, and the router state that ties them to the
ledger. Pure, without Ray."""

from __future__ import annotations

import random

import pytest

from tierserve.records import GenerateRequest, RoutingStats, SamplingParams
from tierserve.replica.prefix_cache import block_hashes
from tierserve.router.policy import Affinity, Charge, ReplicaLoad, RequestShape, rank_replicas
from tierserve.router.prefix_index import PrefixIndex
from tierserve.router.routing import RouterSettings, RouterState

T0 = 1000.0
B = 16
SYSTEM = list(range(1000, 1000 + 10 * B))  # ten full blocks


def stats(free: int = 100, total: int = 100, *, waiting_blocks: int = 0, committed: int = 0,
          at: float = T0) -> RoutingStats:
    return RoutingStats(free_blocks=free, total_blocks=total, block_size=B, report_time=at,
                        waiting_blocks=waiting_blocks, committed_blocks=committed)


def shape(tokens: list[int], *, latency: bool, max_tokens: int = 16, n: int = 1) -> RequestShape:
    return RequestShape(len(tokens) * n, max_tokens * n, latency=latency,
                        prefix=tuple(block_hashes(tokens, B, 7)), samples=n)


def keys(loads: list[ReplicaLoad[str]], request: RequestShape, **kw: object) -> list[str]:
    return [r.key for r in rank_replicas(loads, request, random.Random(0), **kw)]  # type: ignore[arg-type]


# ---------------------------------------------------------------- the index


def test_the_index_matches_leading_names_only_and_stays_bounded() -> None:
    idx: PrefixIndex[str] = PrefixIndex(default_capacity=8)
    idx.record("a", [1, 2, 3, 4])
    assert idx.match("a", [1, 2, 3, 9]) == 3
    assert idx.match("a", [1, 2, 3, 4], limit=2) == 2
    assert idx.match("b", [1]) == 0
    idx.record("a", [10, 11, 12, 13, 14, 15])
    assert idx.size("a") == 8  # the capacity: the least recently sent deep blocks went first
    assert idx.match("a", [10, 11, 12, 13, 14, 15]) == 6 and idx.match("a", [1, 2]) == 2
    idx.set_capacity("a", 3)
    assert idx.size("a") == 3 and idx.match("a", [10, 11, 12]) == 3
    idx.forget(["b"])
    assert idx.size("a") == 0 and idx.capacity("a") == 8
    with pytest.raises(ValueError, match="default_capacity"):
        PrefixIndex(0)


# ---------------------------------------------------------------- the ranking


def test_hits_count_only_whole_blocks_before_the_last_prompt_position() -> None:
    req = shape(SYSTEM, latency=True)  # 160 tokens: 10 blocks, the last one holds position 159
    assert req.usable_prefix(B) == 9
    (r,) = rank_replicas([ReplicaLoad("a", stats(), (), 10)], req, random.Random(0))
    assert r.cached == 9 * B
    assert r.need == 11 - 9  # ceil(161 / 16) blocks, nine of them shared


def test_a_latency_request_goes_where_its_prefix_is_cached_unless_the_queue_costs_more() -> None:
    req = shape([*SYSTEM, 5, 6, 7], latency=True)  # 163 tokens, 10 blocks cached at "hit"
    loads = [ReplicaLoad("cold", stats()), ReplicaLoad("hit", stats(), (), 10)]
    assert keys(loads, req) == ["hit", "cold"]
    # 8 blocks (128 positions) of prefill queued at "hit" still beat computing 160 at "cold".
    loads = [ReplicaLoad("cold", stats()), ReplicaLoad("hit", stats(waiting_blocks=8), (), 10)]
    assert keys(loads, req) == ["hit", "cold"]
    # 12 blocks (192 positions) queued there do not.
    loads = [ReplicaLoad("cold", stats()), ReplicaLoad("hit", stats(waiting_blocks=12), (), 10)]
    assert keys(loads, req) == ["cold", "hit"]


def test_a_throughput_request_follows_a_big_enough_prefix_while_the_replicas_are_balanced() -> None:
    req = shape([*SYSTEM, 5, 6, 7], latency=False)
    busy = [Charge(2, T0 - 1)] * 3  # three requests outstanding from this router
    loads = [ReplicaLoad("idle", stats()), ReplicaLoad("hit", stats(), busy, 10)]
    assert keys(loads, req) == ["hit", "idle"]
    # A prefix under min_hit_fraction of the prompt is not worth the queue.
    loads = [ReplicaLoad("idle", stats()), ReplicaLoad("hit", stats(), busy, 1)]
    assert keys(loads, req) == ["idle", "hit"]
    # Without a prefix: fewest outstanding, as before.
    assert keys([ReplicaLoad("idle", stats()), ReplicaLoad("hit", stats(), busy)], req) == [
        "idle", "hit"]


def test_imbalance_falls_back_to_load_for_both_kinds() -> None:
    busy = [Charge(2, T0 - 1)] * 20  # 20 outstanding against 0: past balance_abs 16
    loads = [ReplicaLoad("idle", stats()), ReplicaLoad("hit", stats(free=76), busy, 10)]
    for latency in (True, False):
        assert keys(loads, shape([*SYSTEM, 5], latency=latency)) == ["idle", "hit"]
    # With a looser balance the prefix wins again.
    loose = Affinity(balance_abs=24)
    for latency in (True, False):
        assert keys(loads, shape([*SYSTEM, 5], latency=latency), affinity=loose) == [
            "hit", "idle"]
    # Both conditions are needed: 20 against 14 is within 1.5x.
    even = [ReplicaLoad("a", stats(), [Charge(2, T0 - 1)] * 14),
            ReplicaLoad("hit", stats(), busy, 10)]
    assert keys(even, shape([*SYSTEM, 5], latency=False)) == ["hit", "a"]


def test_room_comes_before_affinity_and_a_pool_too_small_stays_last() -> None:
    req = shape([*SYSTEM, 5], latency=False, max_tokens=400)
    full = stats(committed=90)  # 10 blocks of room left: the request needs 36 - 10 cached
    loads = [ReplicaLoad("roomy", stats()), ReplicaLoad("hit", full, (), 10)]
    assert keys(loads, req) == ["roomy", "hit"]
    small = [ReplicaLoad("small", stats(total=20), (), 10), ReplicaLoad("big", stats(total=100))]
    ranked = rank_replicas(small, req, random.Random(0))
    assert [r.key for r in ranked] == ["big", "small"] and ranked[1].never_fits  # hits or not


def test_samples_share_the_cached_prefix() -> None:
    req = shape([*SYSTEM, 5], latency=True, n=3)
    (r,) = rank_replicas([ReplicaLoad("a", stats(), (), 10)], req, random.Random(0))
    assert r.cached == 3 * 10 * B
    assert r.need == -(-(3 * 161 + 1) // B) - 30


def test_without_prefix_names_the_ranking_is_the_load_ranking() -> None:
    rng = random.Random(5)
    for _ in range(200):
        loads = [ReplicaLoad(k, stats(rng.randrange(0, 100), waiting_blocks=rng.randrange(20),
                                      committed=rng.randrange(100)),
                             [Charge(1, T0 - 1)] * rng.randrange(6), rng.randrange(4))
                 for k in "abcd"]
        blind = [ReplicaLoad(x.key, x.stats, x.charges) for x in loads]
        for latency in (True, False):
            plain = RequestShape(rng.randrange(1, 300), 16, latency=latency)  # no names
            assert keys(loads, plain) == keys(blind, plain)


def test_affinity_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="balance_rel"):
        Affinity(balance_rel=0.5)
    with pytest.raises(ValueError, match="min_hit_fraction"):
        Affinity(min_hit_fraction=2.0)
    with pytest.raises(ValueError, match="balance_abs"):
        RouterSettings.from_kwargs({"balance_abs": -1})
    with pytest.raises(ValueError, match="prefix_index_blocks"):
        RouterSettings.from_kwargs({"prefix_index_blocks": 0})


# ---------------------------------------------------------------- the router state


def test_a_burst_of_one_system_prompt_sticks_until_the_balance_breaks() -> None:
    state: RouterState[str] = RouterState(RouterSettings(seed=0, balance_abs=3))
    reports = [("a", stats()), ("b", stats()), ("c", stats())]
    where = []
    for i in range(8):
        req = shape([*SYSTEM, i], latency=False)
        where.append(state.route(i, reports, req, i, T0 + 1)[0].key)
    first = where[0]
    # The first four follow the first (0..3 outstanding there, others 0: spread 3 is allowed),
    # then the balance rule sends the next elsewhere, which then has the prefix too.
    assert where[:4] == [first] * 4 and where[4] != first
    assert state.index.size(first) == 10 and state.index.size(where[4]) == 10


def test_affinity_off_records_nothing_and_ranks_by_load() -> None:
    state: RouterState[str] = RouterState(RouterSettings(seed=0, prefix_affinity=False))
    reports = [("a", stats()), ("b", stats())]
    where = [state.route(i, reports, shape([*SYSTEM, i], latency=False), i, T0 + 1)[0].key
             for i in range(4)]
    assert sorted(where) == ["a", "a", "b", "b"]
    assert state.index.size("a") == state.index.size("b") == 0


def test_a_request_taken_elsewhere_is_recharged_and_its_prefix_recorded_there() -> None:
    state: RouterState[str] = RouterState(RouterSettings(seed=0))
    req = shape([*SYSTEM, 1], latency=True)
    first = state.route("k", [("a", stats()), ("b", stats())], req, "r1", T0 + 1)[0].key
    other = "b" if first == "a" else "a"
    state.routed("k", other, "r1", T0 + 2, stats(), lambda: req)
    assert state.index.match(other, req.prefix) == 10
    assert [c.blocks for c in state.ledger.charges(other)] == [-(-(len(SYSTEM) + 2) // B)]
    assert state.ledger.charges(first) == []
    state.completed(other, "r1")
    assert state.ledger.charges(other) == []
    state.forget_replicas({first})
    assert state.index.size(other) == 0


def test_the_ingress_request_carries_the_names_the_replica_gives_its_blocks() -> None:
    tokens = [*SYSTEM, 3, 4]
    request = GenerateRequest(tuple(tokens), SamplingParams(max_tokens=4), n=2,
                              prefix_hashes=tuple(block_hashes(tokens, B, 7)))
    got = RequestShape.from_request(request)
    assert got.prefix == request.prefix_hashes and got.samples == 2
    assert got.prompt_tokens == 2 * len(tokens) and got.usable_prefix(B) == 10
