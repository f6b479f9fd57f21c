"""Flow control at the ingress without Ray: the held queues (strict priority, the tenants' fair
share, capacity, eviction, late requests) and the asyncio gate around them (dispatch window,
shedding, the hold clock, Retry-After, clients that leave while held)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from tierserve.cluster.config import ClusterConfig, FlowConfig, TenantConfig, TierConfig
from tierserve.cluster.flow import BandSpec, FlowQueues, Held, Refused
from tierserve.cluster.gate import FlowGate, Shed, Ticket
from tierserve.cluster.tiers import Caller

BANDS = [BandSpec("interactive", 10_000, 10.0), BandSpec("standard", 10_000, 30.0),
         BandSpec("batch", 10_000, 60.0)]


def held(band: int, tenant: str = "t", at: float = 0.0, weight: float = 1.0,
         item: Any = None) -> Held[Any]:
    return Held(band, tenant, weight, at, item)


def everything(_: int) -> bool:
    return True


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


# ---------------------------------------------------------------------- the queues


def test_higher_bands_go_first_and_arrival_order_holds_inside_a_tenant() -> None:
    q: FlowQueues[str] = FlowQueues(BANDS, 100)
    q.push(held(2, item="b1"))
    q.push(held(1, item="s1"))
    q.push(held(2, item="b2"))
    q.push(held(0, item="i1"))
    q.push(held(1, item="s2"))
    order = []
    while (h := q.pop(everything)) is not None:
        order.append(h.item)
    assert order == ["i1", "s1", "s2", "b1", "b2"]
    assert len(q) == 0


def test_a_band_not_allowed_is_skipped() -> None:
    q: FlowQueues[str] = FlowQueues(BANDS, 100)
    q.push(held(0, item="i"))
    q.push(held(2, item="b"))
    got = q.pop(lambda band: band == 2)
    assert got is not None and got.item == "b"
    assert q.pop(lambda band: False) is None
    assert len(q) == 1


def test_two_backlogged_tenants_of_equal_weight_get_equal_tokens() -> None:
    """Tenant A offers 5x what B offers, both always backlogged: served tokens stay within 10%
    of each other (Jain's index >= 0.95), whatever the request sizes."""
    rng = random.Random(1)
    q: FlowQueues[int] = FlowQueues(BANDS, 10_000)
    for i in range(600):
        q.push(held(1, "A", item=rng.randint(64, 320)))
        if i % 5 == 0:
            q.push(held(1, "B", item=rng.randint(64, 320)))
    served = {"A": 0, "B": 0}
    for _ in range(150):
        h = q.pop(everything)
        assert h is not None
        served[h.tenant] += h.item
        q.charge(1, h.tenant, h.item, 1.0)
    assert abs(served["A"] - served["B"]) <= 0.1 * max(served.values())
    assert jain(list(served.values())) >= 0.95


def test_weights_set_the_shares() -> None:
    q: FlowQueues[int] = FlowQueues(BANDS, 10_000)
    for _ in range(300):
        q.push(held(1, "heavy", weight=3.0, item=100))
        q.push(held(1, "light", weight=1.0, item=100))
    served = {"heavy": 0, "light": 0}
    for _ in range(200):
        h = q.pop(everything)
        assert h is not None
        served[h.tenant] += h.item
        q.charge(1, h.tenant, h.item, h.weight)
    assert served["heavy"] / served["light"] == pytest.approx(3.0, rel=0.05)


def test_a_tenant_below_its_share_gets_all_it_asks_and_banks_no_credit() -> None:
    """B sends one request now and then while A is backlogged: each of B's is served within
    two dispatches of its arrival. After a long idle spell B's counter is lifted to A's, so B
    does not take the band over: the two alternate."""
    q: FlowQueues[str] = FlowQueues(BANDS, 10_000)
    for _ in range(200):
        q.push(held(1, "A", item="a"))

    def pop() -> str:
        h = q.pop(everything)
        assert h is not None
        q.charge(1, h.tenant, 100, 1.0)
        return h.tenant

    for _ in range(10):
        q.push(held(1, "B", item="b"))
        assert "B" in (pop(), pop())
        pop()
        pop()
    for _ in range(40):  # B idle: A alone
        pop()
    for _ in range(6):
        q.push(held(1, "B", item="b"))
    got = [pop() for _ in range(8)]
    assert got.count("B") == 4 and got.count("A") == 4


def test_a_returning_tenant_catches_up_only_what_the_band_served_in_burst_s() -> None:
    """Virtual time, one dispatch of 100 tokens a second, A backlogged. B comes back at 40 s
    with ``burst_s`` 3: it starts where the band was 3 s ago (A's counter then, 300 below
    now), so it goes first for three requests, then the two take turns. C, back at 43 s, gets
    only what the band got past in those 3 s, though B, lifted below A, was the floor 3 s
    before: credit does not chain from one returning tenant to the next."""
    q: FlowQueues[str] = FlowQueues(BANDS, 10_000, burst_s=3.0)
    for _ in range(200):
        q.push(held(1, "A", item="a"))
    clock = iter(range(1_000))

    def pop() -> str:
        h = q.pop(everything, float(next(clock)))
        assert h is not None
        q.charge(1, h.tenant, 100, h.weight)
        return h.tenant

    for _ in range(40):
        assert pop() == "A"
    for _ in range(6):
        q.push(held(1, "B", at=40.0, item="b"))
    assert q.counter(1, "A") == 4000 and q.counter(1, "B") == 3700
    assert [pop() for _ in range(3)] == ["B", "B", "B"]  # at 40, 41, 42
    q.push(held(1, "C", at=43.0, weight=3.0, item="c"))
    # The band had got to 3900 by 40 s (sampled at its dispatches, before their charge), not
    # 3700, where B's lifted counter put the floor: 100 of credit, not 400.
    assert q.counter(1, "C") == 3900
    assert [pop() for _ in range(6)] == ["C", "A", "B", "A", "B", "A"]
    with pytest.raises(ValueError, match="burst_s"):
        FlowQueues(BANDS, 10, burst_s=-1)


@pytest.mark.parametrize("burst_s", [0.0, 5.0])
def test_burst_credit_never_lets_a_tenant_outgrow_a_backlogged_one(burst_s: float) -> None:
    """Virtual time, one dispatch a second, A always backlogged; B sends a few requests now
    and then and goes idle between (it comes back over a hundred times), asking less than its
    share. B is served only while its counter is not above A's, and its credit is at most what
    A got while it was idle, so at every point B has received no more than A plus one request,
    with credit or without."""
    rng = random.Random(7)
    q: FlowQueues[int] = FlowQueues(BANDS, 100_000, burst_s=burst_s)
    for _ in range(5_000):
        q.push(held(1, "A", item=rng.randint(64, 320)))
    served = {"A": 0, "B": 0}
    returns = b_held = 0
    for t in range(3_000):
        if rng.random() < 0.05:
            returns += b_held == 0
            for _ in range(rng.randint(1, 4)):
                q.push(held(1, "B", at=float(t), item=rng.randint(64, 320)))
                b_held += 1
        h = q.pop(everything, float(t))
        assert h is not None
        b_held -= h.tenant == "B"
        served[h.tenant] += h.item
        q.charge(1, h.tenant, h.item, 1.0)
        assert served["B"] <= served["A"] + 320
    assert returns > 100
    assert 0.1 * served["A"] < served["B"] < served["A"]  # B asks less than its share


def test_credit_is_never_more_than_burst_s_worth_whatever_the_samples() -> None:
    """Service charged with no push or pop to sample it (the gate's direct dispatches) must
    not turn into credit: after 1000 s of such charges to A, B coming back gets none of it,
    nor does a tenant whose arrival time is earlier than the band has seen."""
    q: FlowQueues[str] = FlowQueues(BANDS, 100, burst_s=5.0)
    q.push(held(1, "A", at=0.0))
    assert q.pop(everything, 0.0) is not None
    for _ in range(1_000):
        q.charge(1, "A", 100, 1.0)
    q.push(held(1, "A", at=1000.0))
    q.push(held(1, "B", at=1000.5))
    assert q.counter(1, "B") == q.counter(1, "A") == 100_000
    q.push(held(1, "C", at=10.0))  # earlier than the band has seen: no older credit
    assert q.counter(1, "C") == 100_000


def test_a_credited_tenant_does_not_pass_its_credit_on() -> None:
    """B comes back at 40 s with 3 s of credit and still holds the floor (3700) when C comes
    back at 40.2 s: C starts where the band had got by 37.2 s (3800, its dispatch at 38 s),
    not at B's lifted counter."""
    q: FlowQueues[str] = FlowQueues(BANDS, 10_000, burst_s=3.0)
    for _ in range(100):
        q.push(held(1, "A", item="a"))
    for t in range(40):
        h = q.pop(everything, float(t))
        assert h is not None
        q.charge(1, h.tenant, 100, 1.0)
    q.push(held(1, "B", at=40.0))
    q.push(held(1, "C", at=40.2))
    assert (q.counter(1, "A"), q.counter(1, "B"), q.counter(1, "C")) == (4000, 3700, 3800)


@pytest.mark.parametrize(("burst_s", "shed_b"), [(0.0, True), (5.0, False)])
def test_a_burst_below_the_tenants_share_is_not_shed_while_the_tier_is_short(
        burst_s: float, shed_b: bool) -> None:
    """Virtual time: the band dispatches one request a second, A keeps it backlogged with
    three a second, B sends eight at once every 40 s (a fifth of a request a second: well
    below half), every request 200 tokens, held at most 10 s. Without credit B takes turns
    with A and the last of each burst outlives the TTL; with 5 s of credit, every one of B's
    is dispatched in time (A's overflow is shed instead)."""
    q: FlowQueues[str] = FlowQueues([BandSpec("standard", 10_000, 10.0)], 100_000,
                                    burst_s=burst_s)
    shed = {"A": 0, "B": 0}
    sent = {"A": 0, "B": 0}
    for t in range(200):
        now = float(t)
        for _ in range(3):
            q.push(held(0, "A", at=now))
            sent["A"] += 1
        if t % 40 == 5:
            for _ in range(8):
                q.push(held(0, "B", at=now))
                sent["B"] += 1
        for h, reason in q.overdue(now):
            assert reason == "late"
            shed[h.tenant] += 1
        h = q.pop(everything, now)
        if h is not None:
            q.charge(0, h.tenant, 200, 1.0)
    assert sent["B"] == 40
    assert (shed["B"] > 0) is shed_b
    assert shed["A"] > 0


def test_a_full_band_refuses_and_a_full_queue_evicts_the_newest_of_the_lowest_band() -> None:
    q: FlowQueues[str] = FlowQueues([BandSpec("i", 2, 10), BandSpec("s", 8, 10),
                                     BandSpec("b", 8, 10)], 4)
    q.push(held(0, item="i1"))
    q.push(held(0, item="i2"))
    with pytest.raises(Refused) as e:
        q.push(held(0, item="i3"))
    assert e.value.reason == "band_full"
    q.push(held(2, item="b1"))
    q.push(held(2, item="b2"))
    evicted = q.push(held(1, item="s1"))  # full: the newest batch request goes
    assert [h.item for h in evicted] == ["b2"]
    evicted = q.push(held(1, item="s2"))
    assert [h.item for h in evicted] == ["b1"]
    with pytest.raises(Refused) as e:  # nothing below standard is left
        q.push(held(1, item="s3"))
    assert e.value.reason == "queue_full"
    assert len(q) == 4


def test_a_late_request_is_kept_until_newer_demand_arrives() -> None:
    """Held past its band's late_s a request is late, not shed: it is shed once an on-time
    request of its band or above, held, arrived after it became late, and not for one that
    arrived before (a burst's later members)."""
    q: FlowQueues[str] = FlowQueues(BANDS, 100)
    q.push(held(0, at=0.0, item="i-old"))
    q.push(held(0, at=5.0, item="i-burst"))  # arrived before i-old became late (10 s)
    q.push(held(2, at=0.0, item="b-old"))
    assert q.overdue(12.0) == []
    assert q.held(0) == 2 and q.on_time(0) == 1  # i-old late, i-burst not yet
    q.push(held(0, at=12.0, item="i-new"))  # newer demand of the top band
    gone = q.overdue(12.5)
    assert [(h.item, reason) for h, reason in gone] == [("i-old", "late")]
    assert len(q) == 3
    # batch is late only at 60 s; then i-new (12 s) arrived before it became late
    assert q.overdue(61.0) == []
    q.push(held(1, at=61.0, item="s-new"))  # a higher band's newer, on-time request
    gone = q.overdue(61.5)
    assert sorted(h.item for h, _ in gone) == ["b-old"]


def test_a_request_never_counts_as_held_longer_than_one_before_it() -> None:
    """A tenant's queue stays in arrival order (only its head can be late or overdue): an
    arrival stamped earlier than the one before it counts from that one's arrival."""
    q: FlowQueues[str] = FlowQueues(BANDS, 100)
    q.push(held(0, at=5.0, item="a"))
    b = held(0, at=0.0, item="b")
    q.push(b)
    assert b.arrival == 5.0
    assert q.overdue(12.0) == [] and q.on_time(0) == 2
    q.overdue(15.5)
    assert q.on_time(0) == 0 and q.held(0) == 2


def test_a_burst_with_nothing_behind_it_is_served_in_full() -> None:
    """64 requests arrive within a second while the band can start one a second (far past
    late_s): none is shed; the late ones go in arrival order once nothing on time waits."""
    q: FlowQueues[int] = FlowQueues([BandSpec("standard", 256, 10.0)], 1024,
                                    max_hold_s=300.0)
    for i in range(64):
        q.push(held(0, f"t{i % 3}", at=i / 64, item=i))
    served: list[int] = []
    for t in range(1, 100):
        assert q.overdue(float(t)) == []
        h = q.pop(everything, float(t))
        if h is not None:
            served.append(h.item)
            q.charge(0, h.tenant, 100, 1.0)
    assert sorted(served) == list(range(64)) and len(q) == 0


def test_late_requests_yield_to_on_time_ones_of_their_band_only() -> None:
    q: FlowQueues[str] = FlowQueues(BANDS, 100)
    q.push(held(1, at=0.0, item="s-late"))
    q.push(held(2, at=0.0, item="b-late"))
    q.overdue(70.0)  # both late now
    q.push(held(2, at=69.0, item="b-on-time"))
    q.push(held(1, at=69.0, item="s-on-time"))
    order = []
    while (h := q.pop(everything, 70.0)) is not None:
        order.append((h.item, h.late))
    # strict priority between bands holds: a late standard request goes before an on-time
    # batch one; inside a band the on-time go first
    assert order == [("s-on-time", False), ("s-late", True), ("b-on-time", False),
                     ("b-late", True)]


def test_a_full_queue_sheds_late_requests_of_the_lowest_tier_first() -> None:
    q: FlowQueues[str] = FlowQueues([BandSpec("i", 8, 10.0), BandSpec("s", 8, 10.0),
                                     BandSpec("b", 8, 10.0)], 4)
    q.push(held(1, at=0.0, item="s-late"))
    q.push(held(2, at=0.0, item="b-late"))
    q.push(held(2, at=0.0, item="b-late2"))
    q.overdue(11.0)
    q.push(held(2, at=11.0, item="b-on-time"))
    evicted = q.push(held(1, at=11.0, item="s-new"))  # full: the lowest band's late first
    assert [(h.item, h.late) for h in evicted] == [("b-late", True)]
    evicted = q.push(held(1, at=11.0, item="s-new2"))
    assert [h.item for h in evicted] == ["b-late2"]
    # no late one at or below standard left but its own: the standard one goes before
    # evicting the on-time batch request
    evicted = q.push(held(1, at=11.0, item="s-new3"))
    assert [h.item for h in evicted] == ["s-late"]
    evicted = q.push(held(1, at=11.0, item="s-new4"))
    assert [h.item for h in evicted] == ["b-on-time"]


def test_a_full_band_sheds_a_late_request_before_refusing() -> None:
    q: FlowQueues[str] = FlowQueues([BandSpec("s", 2, 10.0)], 100)
    q.push(held(0, "A", at=0.0, item="a-late"))
    q.push(held(0, "A", at=5.0, item="a"))
    q.overdue(11.0)
    evicted = q.push(held(0, "A", at=11.0, item="a-new"))
    assert [(h.item, h.late) for h in evicted] == [("a-late", True)]
    with pytest.raises(Refused):
        q.push(held(0, "A", at=11.0, item="a-refused"))


def test_max_hold_bounds_every_hold_on_the_wall_clock() -> None:
    q: FlowQueues[str] = FlowQueues(BANDS, 100, max_hold_s=300.0)
    a = Held(1, "t", 1.0, 0.0, "stalled", entered=1000.0)
    b = Held(1, "t", 1.0, 0.0, "younger", entered=1200.0)
    q.push(a)
    q.push(b)
    assert q.overdue(0.0, wall=1299.0) == []  # the hold clock stood still: not late either
    assert [(h.item, r) for h, r in q.overdue(0.0, wall=1301.0)] == [("stalled", "max_hold")]
    assert len(q) == 1
    with pytest.raises(ValueError, match="max_hold_s"):
        FlowQueues(BANDS, 4, max_hold_s=0.0)


def test_remove_is_exact_and_idempotent() -> None:
    q: FlowQueues[str] = FlowQueues(BANDS, 100)
    a, b = held(1, item="a"), held(1, item="b")
    q.push(a)
    q.push(b)
    assert q.remove(a) and not q.remove(a)
    got = q.pop(everything)
    assert got is b and len(q) == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="band"):
        FlowQueues([], 4)
    with pytest.raises(ValueError, match="max_held"):
        FlowQueues(BANDS, -1)


# ---------------------------------------------------------------------- the gate


class FakeMetrics:
    def __init__(self) -> None:
        self.sheds: list[tuple[str, str]] = []
        self.tokens: dict[tuple[str, str], int] = {}

    def shed(self, tier: str, reason: str) -> None:
        self.sheds.append((tier, reason))

    def tenant_tokens(self, tier: str, tenant: str, tokens: int) -> None:
        self.tokens[(tier, tenant)] = self.tokens.get((tier, tenant), 0) + tokens

    def flow(self, held: dict[str, int], starting: int, window: int, model: str = "") -> None:
        pass


def config(**flow: Any) -> ClusterConfig:
    tiers = [
        TierConfig(name="interactive", base_priority=10, max_priority=15, queue_share=1.0,
                   max_held=4, late_after_s=0.3),
        TierConfig(name="standard", base_priority=5, max_priority=9, queue_share=0.75,
                   max_held=4, late_after_s=5.0,
                   tenants=[TenantConfig(name="acme", weight=2.0)]),
        TierConfig(name="batch", base_priority=0, max_priority=4, queue_share=0.5,
                   max_held=4, late_after_s=5.0),
    ]
    return ClusterConfig(tiers=tiers, flow=FlowConfig(starting_per_replica=4, **flow))


def roomy(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with every tier holding up to 256 requests."""
    return cfg.model_copy(update={"tiers": [t.model_copy(update={"max_held": 256})
                                            for t in cfg.tiers]})


def caller(cfg: ClusterConfig, tier: str, tenant: str = "default") -> Caller:
    t = next(x for x in cfg.tiers if x.name == tier)
    return Caller(t, t.base_priority, False, tenant, t.weight_of(tenant))


def gate_of(cfg: ClusterConfig) -> tuple[FlowGate, FakeMetrics]:
    m = FakeMetrics()
    return FlowGate(cfg, m, lambda: 1), m  # type: ignore[arg-type]


def test_gate_dispatches_at_once_within_each_tiers_share_of_the_window() -> None:
    async def go() -> None:
        cfg = config()
        gate, _ = gate_of(cfg)
        # window 4: batch may fill 2 slots, standard 3, interactive all 4.
        t1 = await gate.enter(caller(cfg, "batch"), 10)
        await gate.enter(caller(cfg, "batch"), 10)
        held_batch = asyncio.create_task(gate.enter(caller(cfg, "batch"), 10))
        await asyncio.sleep(0.01)
        assert not held_batch.done() and gate.queues.held(2) == 1
        await gate.enter(caller(cfg, "standard"), 10)
        await gate.enter(caller(cfg, "interactive"), 10)
        assert gate.starting == 4
        gate.started(t1)
        gate.started(t1)  # twice is once
        assert gate.starting == 3
        await asyncio.sleep(0.01)
        assert not held_batch.done()  # 3 starting: still past batch's share (2)
        held_batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held_batch
        assert len(gate.queues) == 0
    asyncio.run(go())


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_gate_window_counts_the_tiers_a_replica_would_not_pass(policy: str) -> None:
    """Under priority scheduling a replica admits a request ahead of every lower tier's
    waiting there: a tier's window counts its own starting requests and those of the tiers
    above it, so lower tiers' never hold it here. Under fcfs every starting request counts."""
    async def go() -> None:
        base = config()
        cfg = base.model_copy(update={"engine": base.engine.model_copy(
            update={"scheduling_policy": policy})})
        gate, _ = gate_of(cfg)
        for _ in range(2):  # window 4: batch's share (2) full
            await gate.enter(caller(cfg, "batch"), 1)
        tasks = [asyncio.create_task(gate.enter(caller(cfg, tier), 1))
                 for tier in ["standard"] * 4 + ["interactive"] * 2]
        await asyncio.sleep(0.01)
        done = [t.done() for t in tasks]
        if policy == "priority":
            # standard counts itself and interactive: its share of 3, the fourth held; the
            # interactive ones count themselves (2 of 4): the total passes the window
            assert done == [True] * 3 + [False] + [True] * 2 and gate.starting == 7
            assert gate.starting_by == [2, 3, 2]
        else:
            # standard stops at 3 starting in all, interactive at the whole window of 4
            assert done == [True, False, False, False, True, False] and gate.starting == 4
        first = tasks[0].result()
        gate.started(first)
        gate.started(first)  # twice is once
        assert sum(gate.starting_by) == gate.starting == (6 if policy == "priority" else 3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(gate.queues) == 0
        assert sum(gate.starting_by) == gate.starting
    asyncio.run(go())


def test_gate_serves_held_requests_by_tier_when_slots_free() -> None:
    async def go() -> None:
        cfg = config()
        gate, _ = gate_of(cfg)
        first = [await gate.enter(caller(cfg, "interactive"), 1) for _ in range(4)]
        order: list[str] = []

        async def one(tier: str) -> Ticket:
            t = await gate.enter(caller(cfg, tier), 1)
            order.append(tier)
            gate.started(t)  # answers at once
            return t

        tasks = [asyncio.create_task(one(t)) for t in ("batch", "standard", "interactive")]
        await asyncio.sleep(0.01)
        assert order == []
        for t in first:
            gate.started(t)
            await asyncio.sleep(0.12)
        await asyncio.gather(*tasks)
        assert order == ["interactive", "standard", "batch"]
    asyncio.run(go())


def test_gate_sheds_late_requests_under_contention_and_by_capacity() -> None:
    """Held past late_after_s (0.3 s) with nothing newer waiting, four interactive requests
    stay held (late); one newer request arrives: the late ones are shed with the configured
    status and a Retry-After, and a full band refuses at once."""
    async def go() -> None:
        cfg = config(shed_status=503)
        gate, metrics = gate_of(cfg)
        first = [await gate.enter(caller(cfg, "interactive"), 1) for _ in range(4)]
        held = [asyncio.create_task(gate.enter(caller(cfg, "interactive"), 1))
                for _ in range(3)]
        await asyncio.sleep(0.6)
        assert not any(t.done() for t in held)  # late, not shed: nothing newer waits
        newer = asyncio.create_task(gate.enter(caller(cfg, "interactive"), 1))
        results = await asyncio.gather(*held, return_exceptions=True)
        assert all(isinstance(r, Shed) and r.reason == "late" and r.status == 503
                   for r in results), results
        assert "late_after_s" in str(results[0])
        assert all(isinstance(r, Shed) and r.retry_after is not None and r.retry_after >= 1
                   for r in results)
        assert metrics.sheds.count(("interactive", "late")) == 3
        fill = [asyncio.create_task(gate.enter(caller(cfg, "interactive"), 1))
                for _ in range(3)]  # the band (max_held 4) full behind the newer one
        await asyncio.sleep(0.01)
        with pytest.raises(Shed) as e:
            await gate.enter(caller(cfg, "interactive"), 1)
        assert e.value.reason == "band_full" and e.value.status == 503
        for t in first:
            gate.started(t)
        await newer
        assert not newer.exception()
        for f in fill:
            f.cancel()
        await asyncio.gather(*fill, return_exceptions=True)
        assert len(gate.queues) == 0
    asyncio.run(go())


def test_gate_serves_a_burst_in_full_when_nothing_newer_comes() -> None:
    """A window of 4, 24 requests at once, each answering its first token after 0.1 s (far
    past the interactive tier's late_after_s of 0.3 s for the last of them): all are served."""
    async def go() -> None:
        cfg = roomy(config())
        gate, metrics = gate_of(cfg)

        async def one() -> None:
            t = await gate.enter(caller(cfg, "interactive"), 1)
            await asyncio.sleep(0.1)
            gate.started(t)

        results = await asyncio.gather(*(one() for _ in range(24)), return_exceptions=True)
        assert all(r is None for r in results), results
        assert metrics.sheds == [] and len(gate.queues) == 0
    asyncio.run(go())


def test_gate_hold_clock_stands_still_until_the_replicas_are_ready() -> None:
    """Requests held while the replicas cannot take work are not charged for it: late only
    late_after_s after readiness, whatever they waited before."""
    async def go() -> None:
        cfg = config()
        state = {"ready": False}
        m = FakeMetrics()
        gate = FlowGate(cfg, m, lambda: 1, lambda: state["ready"])  # type: ignore[arg-type]
        first = [await gate.enter(caller(cfg, "interactive"), 1) for _ in range(4)]
        held = [asyncio.create_task(gate.enter(caller(cfg, "interactive"), 1))
                for _ in range(2)]
        await asyncio.sleep(0.5)  # past late_after_s (0.3 s) on the wall clock
        gate.pump_once(time.monotonic())
        assert gate.hold_clock == 0.0
        newer = asyncio.create_task(gate.enter(caller(cfg, "interactive"), 1))
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in held)  # none late: nothing was charged
        state["ready"] = True
        await asyncio.sleep(0.2)
        assert 0.0 < gate.hold_clock < 0.3 and not any(t.done() for t in held)
        for t in first:
            gate.started(t)
        await asyncio.gather(*held, newer)
        assert m.sheds == []
    asyncio.run(go())


def test_gate_retry_after_follows_the_rate_its_tier_starts_requests() -> None:
    cfg = roomy(config())
    gate, _ = gate_of(cfg)
    # Nothing dispatched yet: the rate is unknown.
    assert gate.retry_after(2, now=100.0) == 10
    # 40 dispatches of interactive and batch over 20 s: 2 a second for bands <= 2, 1 for 0.
    for i in range(20):
        gate._dispatched.append((80.0 + i, 0))
        gate._dispatched.append((80.0 + i + 0.5, 2))
    for _ in range(3):
        gate.queues.push(Held(0, "t", 1.0, 0.0, None))  # type: ignore[arg-type]
    # interactive: 3 held + 1 at 20/20 s -> 4 s; batch: the same 4 at 40/20 s -> 2 s
    assert gate.retry_after(0, now=100.0) == 4
    assert gate.retry_after(2, now=100.0) == 2
    # at least the config's retry_after_s, at most 60 s
    gate.min_retry_after = 3
    assert gate.retry_after(2, now=100.0) == 3
    for _ in range(200):
        gate.queues.push(Held(1, "u", 1.0, 0.0, None))  # type: ignore[arg-type]
    assert gate.retry_after(1, now=100.0) == 60


def test_gate_evicts_a_lower_tier_for_a_higher_one_when_full() -> None:
    async def go() -> None:
        cfg = config(max_held=2)
        gate, metrics = gate_of(cfg)
        for _ in range(4):
            await gate.enter(caller(cfg, "interactive"), 1)
        low = [asyncio.create_task(gate.enter(caller(cfg, "batch"), 1)) for _ in range(2)]
        await asyncio.sleep(0.01)
        top = asyncio.create_task(gate.enter(caller(cfg, "interactive"), 1))
        await asyncio.sleep(0.01)
        assert low[1].done() and isinstance(low[1].exception(), Shed)
        assert not low[0].done() and not top.done()
        assert ("batch", "evicted") in metrics.sheds
        for t in (low[0], top):
            t.cancel()
        await asyncio.gather(low[0], top, return_exceptions=True)
        assert len(gate.queues) == 0
    asyncio.run(go())


def test_gate_charges_tenants_and_names_unknown_ones_other() -> None:
    async def go() -> None:
        cfg = config()
        gate, metrics = gate_of(cfg)
        t = await gate.enter(caller(cfg, "standard", "acme"), 30)
        gate.charge(t, 10)
        u = await gate.enter(caller(cfg, "standard", "someone-else"), 5)
        assert metrics.tokens[("standard", "acme")] == 40
        assert metrics.tokens[("standard", "other")] == 5
        assert gate.queues.counter(1, "acme") == pytest.approx(20.0)  # weight 2
        assert u.weight == 1.0
    asyncio.run(go())


def test_flow_config_is_validated() -> None:
    with pytest.raises(ValueError, match="starting_per_replica"):
        FlowConfig(starting_per_replica=0)
    with pytest.raises(ValueError, match="shed_status"):
        FlowConfig(shed_status=500)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tenant_header"):
        FlowConfig(tenant_header="bad header")
    with pytest.raises(ValueError, match="tenant names must be unique"):
        TierConfig(name="x", base_priority=0, max_priority=0,
                   tenants=[TenantConfig(name="a"), TenantConfig(name="a")])
    with pytest.raises(ValueError, match="more than one tier"):
        ClusterConfig(tiers=[
            TierConfig(name="a", base_priority=0, max_priority=0, api_keys=["k1"]),
            TierConfig(name="b", base_priority=1, max_priority=1,
                       tenants=[TenantConfig(name="t", api_keys=["k1"])])])
    with pytest.raises(ValueError, match="ttft_target_s"):
        TierConfig(name="x", base_priority=0, max_priority=0, ttft_target_s=0)
    with pytest.raises(ValueError, match="held_ttl_s is now late_after_s"):
        TierConfig(name="x", base_priority=0, max_priority=0, held_ttl_s=10)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="max_hold_s"):
        FlowConfig(max_hold_s=0)


def test_aging_lets_a_starved_band_through_within_its_share() -> None:
    """A steady stream of standard requests: a batch request held past aging_s goes ahead of
    them, but aged dispatches stay within aged_share (here 1 in 4)."""
    q: FlowQueues[str] = FlowQueues(BANDS, 10_000, aging_s=10.0, aged_share=0.25)
    for i in range(8):
        q.push(held(2, at=float(i), item=f"b{i}"))
    for i in range(40):
        q.push(held(1, at=100.0, item=f"s{i}"))
    young = [q.pop(everything, now=5.0) for _ in range(4)]
    assert all(h is not None and h.band == 1 for h in young)  # not aged yet
    out = [q.pop(everything, now=100.0) for _ in range(36)]
    bands = [h.band for h in out if h is not None]
    assert 0 < bands.count(2) <= 0.25 * 40 + 1
    assert [h.item for h in out if h is not None and h.band == 2] == [
        f"b{i}" for i in range(bands.count(2))]  # the oldest first
    strict: FlowQueues[str] = FlowQueues(BANDS, 10_000)  # aging_s None: strict priority
    strict.push(held(2, at=0.0, item="b"))
    strict.push(held(1, at=50.0, item="s"))
    got = strict.pop(everything, now=100.0)
    assert got is not None and got.item == "s"
    with pytest.raises(ValueError, match="aging_s"):
        FlowQueues(BANDS, 4, aging_s=0.0)
    with pytest.raises(ValueError, match="aged_share"):
        FlowQueues(BANDS, 4, aged_share=1.5)


def test_a_full_band_makes_room_for_a_tenant_holding_fewer() -> None:
    """Tenant A floods the band to its max_held: B's request evicts A's newest instead of
    being refused; A's next one is refused."""
    q: FlowQueues[str] = FlowQueues([BandSpec("s", 4, 30.0)], 100)
    for i in range(4):
        q.push(held(0, "A", item=f"a{i}"))
    evicted = q.push(held(0, "B", item="b0"))
    assert [h.item for h in evicted] == ["a3"]
    with pytest.raises(Refused):
        q.push(held(0, "A", item="a4"))
    q.push(held(0, "B", item="b1"))  # A holds 3, B 1: A gives up another
    with pytest.raises(Refused):  # A 2, B 2: nobody holds more than the other
        q.push(held(0, "B", item="b2"))
    assert q.held(0) == 4
