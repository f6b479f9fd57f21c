"""The ranking policy and the stats contract, without Ray."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest

from tierserve.records import RoutingStats
from tierserve.router.policy import (
    GATHER_PREFILL_S,
    Charge,
    ReplicaLoad,
    RequestShape,
    charge_blocks,
    rank_replicas,
    seats_for,
)

T0 = 1000.0


def stats(
    free: int, total: int = 100, *, at: float = T0, waiting: int = 0, **kw: int
) -> RoutingStats:
    return RoutingStats(
        free_blocks=free, total_blocks=total, block_size=16, waiting=waiting, report_time=at, **kw
    )


def order(loads: list[ReplicaLoad[str]], prompt: int = 31, seed: int = 0,
          latency: bool = True, max_tokens: int = 0) -> list[str]:
    """The ranking of a request, by default one routed for its first token."""
    shape = RequestShape(prompt, max_tokens, latency=latency)
    return [r.key for r in rank_replicas(loads, shape, random.Random(seed))]


# ---------------------------------------------------------------- stats contract


def test_stats_round_trip_through_json() -> None:
    s = RoutingStats(
        10, 64, 16, waiting=2, running=3, preemptions=1, report_time=T0, waiting_blocks=4
    )
    d = json.loads(json.dumps(s.to_dict()))
    assert RoutingStats.from_dict(d) == s


def test_empty_report_means_no_report_yet() -> None:
    assert RoutingStats.from_dict({}) is None
    assert RoutingStats.from_dict(None) is None


def test_report_tolerates_unknown_keys_and_defaults_optional_ones() -> None:
    d = {"free_blocks": 3, "total_blocks": 8, "block_size": 16, "report_time": 5, "extra": "x"}
    assert RoutingStats.from_dict(d) == RoutingStats(3, 8, 16, report_time=5.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"free_blocks": 1},
        {"free_blocks": "1", "total_blocks": 8, "block_size": 16, "report_time": 0},
        {"free_blocks": 1.5, "total_blocks": 8, "block_size": 16, "report_time": 0},
        {"free_blocks": 1, "total_blocks": 8, "block_size": 0, "report_time": 0},
    ],
)
def test_malformed_report_is_an_error(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="routing stats"):
        RoutingStats.from_dict(bad)


# ---------------------------------------------------------------- charges and estimates


@pytest.mark.parametrize(("prompt", "blocks"), [(0, 1), (15, 1), (16, 2), (31, 2), (32, 3)])
def test_charge_is_prompt_plus_first_token(prompt: int, blocks: int) -> None:
    assert charge_blocks(prompt, 16) == blocks


def est_free(load: ReplicaLoad[str]) -> int:
    """The ranking's estimate of the free blocks of a replica ranked alone."""
    (ranked,) = rank_replicas([load], RequestShape(31, latency=True), random.Random(0))
    return ranked.est_free


def test_charges_before_the_report_are_not_subtracted_twice() -> None:
    charges = [Charge(10, T0 - 1), Charge(7, T0 + 1), Charge(3, T0)]
    assert est_free(ReplicaLoad("a", stats(50, at=T0), charges)) == 50 - 7 - 3


def test_waiting_blocks_count_against_free_blocks() -> None:
    assert est_free(ReplicaLoad("a", stats(50, waiting=2, waiting_blocks=12))) == 38


def test_ranks_by_reported_free_blocks() -> None:
    loads = [ReplicaLoad("a", stats(10)), ReplicaLoad("b", stats(90)), ReplicaLoad("c", stats(40))]
    assert order(loads) == ["b", "c", "a"]


def test_in_flight_corrects_a_stale_report() -> None:
    # b reported the most, but this router has sent it 60 blocks since: c is now best.
    loads = [
        ReplicaLoad("b", stats(90), [Charge(30, T0 + 0.1), Charge(30, T0 + 0.2)]),
        ReplicaLoad("c", stats(40)),
    ]
    assert order(loads) == ["c", "b"]


def test_completed_requests_are_no_longer_charged() -> None:
    # The same situation once both requests completed (the router dropped their charges).
    loads = [ReplicaLoad("b", stats(90), []), ReplicaLoad("c", stats(40))]
    assert order(loads) == ["b", "c"]


def test_a_newer_report_absorbs_older_charges() -> None:
    charge = Charge(60, T0 + 0.1)
    old = [ReplicaLoad("b", stats(90), [charge]), ReplicaLoad("c", stats(40))]
    new = [ReplicaLoad("b", stats(30, at=T0 + 1), [charge]), ReplicaLoad("c", stats(40))]
    assert order(old) == ["c", "b"]
    assert order(new) == ["c", "b"]
    assert est_free(new[0]) == 30


def test_ties_are_broken_at_random() -> None:
    loads = [ReplicaLoad(k, stats(50)) for k in "abcd"]
    firsts = Counter(order(loads, seed=seed)[0] for seed in range(400))
    assert set(firsts) == set("abcd")
    assert min(firsts.values()) > 60  # about 100 each
    assert order(loads, seed=7) == order(loads, seed=7)


def test_a_replica_is_ranked_only_once_it_reports_its_pool() -> None:
    """A new replica (autoscaling, a restart) goes after every reported one, even a busy or
    saturated one, until its report says what its pool holds; then it is ranked on it."""
    old = stats(20, total=100)
    for loads in ([ReplicaLoad("old", old), ReplicaLoad("new", None)],
                  [ReplicaLoad("new", None), ReplicaLoad("old", stats(0, total=100, waiting=30))]):
        for latency in (False, True):
            ranked = rank_replicas(loads, RequestShape(31, latency=latency), random.Random(0))
            assert [r.key for r in ranked] == ["old", "new"]
            assert ranked[1].unreported and not ranked[0].unreported
    assert order([ReplicaLoad("old", old), ReplicaLoad("new", stats(100, total=100))]) == [
        "new", "old"]
    # Only a dead replica ranks below it.
    dead = ReplicaLoad("old", replace(old, alive=False))
    assert order([dead, ReplicaLoad("new", None)]) == ["new", "old"]


def test_without_any_report_fewest_outstanding_blocks_wins() -> None:
    loads = [
        ReplicaLoad("a", None, [Charge(4, T0)]),
        ReplicaLoad("b", None, []),
        ReplicaLoad("c", None, [Charge(2, T0)]),
    ]
    assert order(loads) == ["b", "c", "a"]
    ranked = rank_replicas(loads, RequestShape(31), random.Random(0))
    assert not any(r.saturated for r in ranked)  # nothing is known against them


def test_saturated_replicas_rank_last() -> None:
    # a has more free blocks than b, but not enough for the request, and a long queue.
    loads = [ReplicaLoad("a", stats(3, waiting=9)), ReplicaLoad("b", stats(2, waiting=1))]
    ranked = rank_replicas(loads, RequestShape(63), random.Random(0), saturation_waiting=8)
    assert [r.key for r in ranked] == ["b", "a"]
    assert [r.saturated for r in ranked] == [False, True]
    assert ranked[1].need == 4


def test_requests_sent_since_the_report_lengthen_the_queue() -> None:
    charges = [Charge(1, T0 + 1)] * 3
    load = ReplicaLoad("a", stats(2, waiting=5), charges)
    ranked = rank_replicas([load], RequestShape(63), random.Random(0), saturation_waiting=8)
    assert ranked[0].est_waiting == 8 and ranked[0].saturated


def test_a_pool_too_small_for_the_whole_request_ranks_last() -> None:
    loads = [ReplicaLoad("small", stats(8, total=8)), ReplicaLoad("big", stats(5, total=100))]
    ranked = rank_replicas(loads, RequestShape(31, max_tokens=200), random.Random(0))
    assert [r.key for r in ranked] == ["big", "small"]
    assert ranked[1].never_fits
    # A request no pool can ever hold is not "saturated": the replica refuses it at once.
    only_small = rank_replicas(loads[:1], RequestShape(31, 200), random.Random(0))
    assert only_small[0].never_fits and not only_small[0].saturated


# ---------------------------------------------------------------- the two rankings


def test_latency_requests_avoid_queued_prefill_work() -> None:
    # a has more free blocks, but a long prompt waits there (admitted in the same step as ours).
    loads = [ReplicaLoad("a", stats(90, waiting=1, waiting_blocks=60)),
             ReplicaLoad("b", stats(40))]
    assert order(loads) == ["b", "a"]
    # ... unless b cannot hold the prompt now.
    loads[1] = ReplicaLoad("b", stats(1))
    assert order(loads) == ["a", "b"]


def test_latency_requests_count_prompts_sent_since_the_report_as_queued_work() -> None:
    loads = [ReplicaLoad("a", stats(90), [Charge(20, T0 + 1)]), ReplicaLoad("b", stats(60))]
    ranked = rank_replicas(loads, RequestShape(31, latency=True), random.Random(0))
    assert [r.key for r in ranked] == ["b", "a"]
    assert [r.pending for r in ranked] == [0, 20]


def test_throughput_requests_go_where_their_whole_length_fits() -> None:
    # a has more free blocks now, but its running requests are promised most of its pool.
    loads = [ReplicaLoad("a", stats(80, committed_blocks=90)), ReplicaLoad("b", stats(30))]
    ranked = rank_replicas(loads, RequestShape(31, 200), random.Random(0))
    assert [r.key for r in ranked] == ["b", "a"]
    assert [(r.room, r.full) for r in ranked] == [(100, 15), (10, 15)]


def test_throughput_requests_spread_by_outstanding_count() -> None:
    # Both have room; b has fewer of this router's requests in flight.
    loads = [ReplicaLoad("a", stats(90), [Charge(1, T0 - 1, 3)] * 3),
             ReplicaLoad("b", stats(50), [Charge(1, T0 - 1, 3)])]
    assert order(loads, latency=False, max_tokens=16) == ["b", "a"]
    # Charges since the report count at their full length against the room.
    loads = [ReplicaLoad("a", stats(90), [Charge(2, T0 + 1, 99)]), ReplicaLoad("b", stats(50),
                                                                            [Charge(1, T0 + 1)] * 2)]
    assert order(loads, latency=False, max_tokens=16) == ["b", "a"]


def test_the_latency_flag_splits_the_rankings() -> None:
    loads = [ReplicaLoad("a", stats(90, waiting=1, waiting_blocks=60), [Charge(1, T0 - 1)]),
             ReplicaLoad("b", stats(40))]
    assert order(loads, latency=True) == ["b", "a"]
    assert order(loads, latency=False) == ["b", "a"]  # fewer outstanding
    loads[1] = ReplicaLoad("b", stats(40), [Charge(1, T0 - 1)] * 2)
    assert order(loads, latency=False) == ["a", "b"]


def test_a_replica_whose_engine_failed_ranks_last() -> None:
    loads = [ReplicaLoad("dead", stats(100, alive=0)), ReplicaLoad("busy", stats(1, waiting=20))]
    for latency in (False, True):
        ranked = rank_replicas(loads, RequestShape(31, 8, latency=latency), random.Random(0))
        assert [(r.key, r.dead) for r in ranked] == [("busy", False), ("dead", True)]


# ---------------------------------------------------------------- seats within a step limit


def test_a_request_with_a_tpot_target_goes_where_a_seat_is_left() -> None:
    """The replica with more free blocks has no seat left within its SLO-aware step: a request
    with a TPOT target goes to the other; one without a target still goes by blocks."""
    loads = [ReplicaLoad("full", stats(90, seats=0, step_limit_ms=80)),
             ReplicaLoad("room", stats(40, seats=3, step_limit_ms=80))]
    with_target = RequestShape(31, 0, latency=True, tpot_target_s=0.1)
    ranked = rank_replicas(loads, with_target, random.Random(0))
    assert [r.key for r in ranked] == ["room", "full"]
    assert ranked[1].no_seat and not ranked[0].no_seat
    assert order(loads) == ["full", "room"]


def test_the_strictest_targets_seats_are_its_own() -> None:
    """A replica keeping the 100 ms target whose step is full of lower tiers' decodes (no seat)
    still has seats for a 100 ms request (the lower tiers' decodes give way to it); a 500 ms
    request has none there, nor a stricter one (it would take a seat by preemption); nor has
    a 100 ms request where the steps do not pass the lower tiers (``slo_steps`` 0: fcfs); a
    report without ``target_seats`` (-1) falls back to ``seats``."""
    full = stats(90, seats=0, target_seats=4, step_limit_ms=70, tpot_target_ms=100, slo_steps=1)
    other = stats(40, seats=2, target_seats=2, step_limit_ms=70, tpot_target_ms=100,
                  slo_steps=1)
    loads = [ReplicaLoad("full", full), ReplicaLoad("other", other)]

    def no_seat(target_s: float) -> dict[str, bool]:
        shape = RequestShape(31, 0, latency=target_s <= 0.1, tpot_target_s=target_s)
        return {r.key: r.no_seat for r in rank_replicas(loads, shape, random.Random(0))}

    assert no_seat(0.1) == {"full": False, "other": False}
    assert no_seat(0.05) == {"full": True, "other": False}
    assert no_seat(0.5) == {"full": True, "other": False}
    assert seats_for(full, 0.1) == 4 and seats_for(full, 0.5) == 0
    assert seats_for(full, 0.05) == 0
    assert seats_for(replace(full, slo_steps=0), 0.1) == 0
    old = stats(90, seats=1, step_limit_ms=70, tpot_target_ms=100, slo_steps=1)
    assert old.target_seats == -1 and seats_for(old, 0.1) == 1
    # What was sent since the report takes its seats too.
    charges = [Charge(blocks=2, routed_at=T0 + k) for k in (1, 2, 3, 4)]
    taken = [ReplicaLoad("full", full, charges), ReplicaLoad("other", other)]
    ranked = rank_replicas(taken, RequestShape(31, 0, latency=True, tpot_target_s=0.1),
                           random.Random(0))
    assert [(r.key, r.no_seat) for r in ranked] == [("other", False), ("full", True)]


def test_seats_count_what_was_sent_since_the_report() -> None:
    charges = [Charge(blocks=2, routed_at=T0 + 1), Charge(blocks=2, routed_at=T0 + 2)]
    loads = [ReplicaLoad("a", stats(90, seats=2), charges),
             ReplicaLoad("b", stats(40, seats=1))]
    shape = RequestShape(31, 0, latency=True, tpot_target_s=0.1)
    assert [r.key for r in rank_replicas(loads, shape, random.Random(0))] == ["b", "a"]


def test_a_stats_report_carries_the_step_limit_and_seats() -> None:
    from tierserve.records import EngineStats

    s = RoutingStats.from_engine(EngineStats(running=3, waiting=0, free_blocks=10, total_blocks=20,
                                             block_size=16, step_limit_s=0.0804, seats=5,
                                             target_seats=7, target_prefill=230,
                                             slo_steps=True, target_prefill_per_s=412.6),
                                 T0, True)
    assert (s.step_limit_ms, s.seats, s.target_seats, s.target_prefill, s.slo_steps,
            s.target_prefill_per_s) == (80, 5, 7, 230, 1, 413)
    assert RoutingStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_a_request_with_a_target_joins_a_replica_already_keeping_it() -> None:
    """Of three replicas with seats, the one already keeping the 100 ms target takes a request
    with that target, though the others have more free blocks; a request with a 500 ms target
    goes to the one keeping 500 ms, not to the stricter one."""
    loads = [ReplicaLoad("free", stats(90, seats=30)),
             ReplicaLoad("loose", stats(80, seats=30, step_limit_ms=400, tpot_target_ms=500)),
             ReplicaLoad("limited", stats(40, seats=3, step_limit_ms=80, tpot_target_ms=100))]
    top = rank_replicas(loads, RequestShape(31, 0, latency=True, tpot_target_s=0.1),
                        random.Random(0))
    assert top[0].key == "limited" and not top[0].unconstrained
    assert {r.key for r in top[1:]} == {"free", "loose"}
    mid = rank_replicas(loads, RequestShape(31, 0, tpot_target_s=0.5), random.Random(0))
    assert mid[0].key == "loose"
    crowded = [ReplicaLoad("free", stats(90, seats=30)),
               ReplicaLoad("limited", stats(40, seats=9, step_limit_ms=80, tpot_target_ms=100,
                                            target_requests=4))]
    spread = rank_replicas(crowded, RequestShape(31, 0, latency=True, tpot_target_s=0.1),
                           random.Random(0))
    assert spread[0].key == "free"  # four there already: it spreads


def test_a_latency_request_counts_only_its_targets_prefill_where_steps_let_it_pass() -> None:
    """With SLO-aware steps a top-tier request passes the lower tiers' queue: between two
    replicas keeping its target (both worth gathering at), it goes where less of its own tier's
    prompts is ahead (100 positions there against a long queue of lower tiers here); without
    those steps the whole queue counts, as before."""
    busy_top = stats(60, seats=3, step_limit_ms=70, tpot_target_ms=100, target_requests=2,
                     target_prefill=100, slo_steps=1, target_prefill_per_s=300, waiting=1,
                     waiting_blocks=2)
    long_queue = stats(60, seats=3, step_limit_ms=70, tpot_target_ms=100, target_requests=2,
                       target_prefill=0, slo_steps=1, target_prefill_per_s=300, waiting=6,
                       waiting_blocks=40)
    shape = RequestShape(100, 16, latency=True, tpot_target_s=0.1)
    loads = [ReplicaLoad("busy-top", busy_top), ReplicaLoad("long-queue", long_queue)]
    ranked = rank_replicas(loads, shape, random.Random(0))
    assert not any(r.unconstrained for r in ranked)  # both gather: the prefill ahead decides
    assert [(r.key, r.prefill_ahead) for r in ranked] == [("long-queue", 100), ("busy-top", 200)]
    off = [ReplicaLoad(k, replace(s, slo_steps=0)) for k, s in
           (("busy-top", busy_top), ("long-queue", long_queue))]
    assert [r.key for r in rank_replicas(off, shape, random.Random(0))] == ["busy-top",
                                                                           "long-queue"]
    # A lower tier's request is not a latency one: the whole queue counts for it.
    lower = rank_replicas(loads, RequestShape(100, 16, tpot_target_s=0.5), random.Random(0))
    assert {r.key: r.prefill_ahead for r in lower} == {"busy-top": 2 * 16 + 100,
                                                       "long-queue": 40 * 16 + 100}


def test_a_latency_request_gathers_only_while_little_of_its_tier_is_ahead() -> None:
    """A replica keeping the top tier's target takes the next such request while the prompts
    of that tier ahead there take under GATHER_PREFILL_S at the rate it reports (it loses
    nothing more); past that, a replica without a target starts it sooner. Latency requests sent
    since the report count too."""
    rate = 200  # prompt positions a second within the limit

    def keeping(ahead: int) -> RoutingStats:
        return stats(60, seats=3, step_limit_ms=70, tpot_target_ms=100, target_requests=1,
                     target_prefill=ahead, slo_steps=1, target_prefill_per_s=rate)

    lax = stats(60, seats=20, step_limit_ms=350, tpot_target_ms=500, target_requests=6,
                slo_steps=1, waiting=4, waiting_blocks=40)
    shape = RequestShape(100, 16, latency=True, tpot_target_s=0.1)
    edge = round(GATHER_PREFILL_S * rate)
    for ahead, first in ((edge - 1, "keeping"), (edge, "lax")):
        loads = [ReplicaLoad("keeping", keeping(ahead)), ReplicaLoad("lax", lax)]
        ranked = rank_replicas(loads, shape, random.Random(0))
        assert ranked[0].key == first, ahead
    # Nothing reported ahead, but a latency request of 200 positions sent since the report.
    sent = [Charge(7, T0 + 1, 8, prefill=200)]
    loads = [ReplicaLoad("keeping", keeping(0), sent), ReplicaLoad("lax", lax)]
    ranked = rank_replicas(loads, shape, random.Random(0))
    assert ranked[0].key == "lax" and ranked[0].prefill_ahead == 100
    assert ranked[1].prefill_ahead == 300
