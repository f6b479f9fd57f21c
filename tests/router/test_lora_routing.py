"""The router weighs LoRA adapters (tierserve.router.policy's module docstring), without Ray: a
replica holding the request's adapter (reported, or sent since the report) is preferred by the
load's cost, balance still wins, a replica serving no adapters ranks last, and a base-model
request ranks as it did without adapters."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tierserve import LoRARequest, SamplingParams
from tierserve.records import GenerateRequest, RoutingStats
from tierserve.router.policy import (
    Affinity,
    Charge,
    ReplicaLoad,
    RequestShape,
    holds_adapter,
    rank_replicas,
)
from tierserve.router.routing import RouterSettings, RouterState

T0 = 1000.0
LOAD = Affinity().adapter_load_tokens


def stats(free: int = 80, *, adapters: tuple[str, ...] = (), max_loras: int = 2,
          waiting_blocks: int = 0, waiting: int = 0) -> RoutingStats:
    return RoutingStats(free_blocks=free, total_blocks=100, block_size=16, waiting=waiting,
                        report_time=T0, waiting_blocks=waiting_blocks,
                        lora_adapters=adapters, max_loras=max_loras)


def first(loads: list[ReplicaLoad[str]], *, lora: str | None = "sql", latency: bool = True,
          seed: int = 0, affinity: Affinity | None = None) -> str:
    shape = RequestShape(31, 8, latency=latency, lora=lora)
    return rank_replicas(loads, shape, random.Random(seed), affinity=affinity)[0].key


def order(loads: list[ReplicaLoad[str]], *, lora: str | None = "sql", latency: bool = True,
          seed: int = 0) -> list[str]:
    shape = RequestShape(31, 8, latency=latency, lora=lora)
    return [r.key for r in rank_replicas(loads, shape, random.Random(seed))]


def charges(n: int, *, at: float, lora: str | None = None) -> list[Charge]:
    return [Charge(2, at, 3, 0, lora) for _ in range(n)]


@pytest.mark.parametrize("latency", [True, False])
def test_the_replica_holding_the_adapter_wins_at_equal_load(latency: bool) -> None:
    loads = [ReplicaLoad("cold", stats()), ReplicaLoad("warm", stats(adapters=("chat", "sql")))]
    for seed in range(20):
        assert first(loads, latency=latency, seed=seed) == "warm"
        assert first(loads[::-1], latency=latency, seed=seed) == "warm"


def test_the_load_cost_weighs_against_the_queue_both_ways() -> None:
    """Top tier: the adapter's load counts as ``adapter_load_tokens`` prefill positions."""
    blocks = LOAD // 16  # the load's cost, in queued blocks of 16 positions
    short_queue = stats(adapters=("sql",), waiting_blocks=blocks - 2, waiting=1)
    long_queue = stats(adapters=("sql",), waiting_blocks=blocks + 2, waiting=1)
    for seed in range(10):
        assert first([ReplicaLoad("warm", short_queue), ReplicaLoad("cold", stats())],
                     seed=seed) == "warm"
        assert first([ReplicaLoad("warm", long_queue), ReplicaLoad("cold", stats())],
                     seed=seed) == "cold"
    # A dearer load keeps the request where its adapter is.
    dear = Affinity(adapter_load_tokens=LOAD * 4)
    assert first([ReplicaLoad("warm", long_queue), ReplicaLoad("cold", stats())],
                 affinity=dear) == "warm"
    # 0: no adapter affinity at all.
    free = Affinity(adapter_load_tokens=0)
    assert first([ReplicaLoad("warm", short_queue), ReplicaLoad("cold", stats())],
                 affinity=free) == "cold"


def test_lower_tiers_take_the_adapter_as_a_tie_break_after_the_load() -> None:
    """Throughput: fewer requests outstanding first; between equals, the adapter held."""
    for seed in range(10):
        busier = [ReplicaLoad("warm", stats(adapters=("sql",)), charges(2, at=T0 - 1)),
                  ReplicaLoad("cold", stats(), charges(1, at=T0 - 1))]
        assert first(busier, latency=False, seed=seed) == "cold"
        equal = [ReplicaLoad("warm", stats(adapters=("sql",)), charges(1, at=T0 - 1)),
                 ReplicaLoad("cold", stats(), charges(1, at=T0 - 1))]
        assert first(equal, latency=False, seed=seed) == "warm"


def test_adapters_sent_since_the_report_count_as_held() -> None:
    unseen = charges(1, at=T0 + 1, lora="sql")  # after the report: loaded there by now
    loads = [ReplicaLoad("sent", stats(), unseen), ReplicaLoad("other", stats(), charges(1, at=T0 + 1))]
    for seed in range(10):
        assert first(loads, seed=seed) == "sent"
        assert first(loads, latency=False, seed=seed) == "sent"
    # Another adapter sent there does not count; and a report taken after the charge is trusted
    # (the replica says what it holds: perhaps evicted since).
    assert {first([ReplicaLoad("sent", stats(), charges(1, at=T0 + 1, lora="chat")),
                   ReplicaLoad("other", stats(), charges(1, at=T0 + 1))], seed=s)
            for s in range(20)} == {"sent", "other"}
    seen = charges(1, at=T0 - 1, lora="sql")
    assert {first([ReplicaLoad("sent", stats(), seen),
                   ReplicaLoad("other", stats(), charges(1, at=T0 - 1))], seed=s)
            for s in range(20)} == {"sent", "other"}
    # Before any report, what this router sent is all that is known.
    assert first([ReplicaLoad("sent", None, unseen), ReplicaLoad("other", None, charges(1, at=T0))]
                 ) == "sent"


def test_a_burst_of_one_adapter_follows_its_first_request() -> None:
    """Through the router's state: the first request's tentative charge names its adapter, so
    the next request of that adapter, routed before any report shows it, goes to the same
    replica (while the queue there costs less than loading the adapter elsewhere)."""
    state: RouterState[str] = RouterState(RouterSettings(seed=0))
    reports = [("a", stats()), ("b", stats())]
    request = GenerateRequest.of(list(range(20)), SamplingParams(max_tokens=4),
                                 lora=LoRARequest("sql", 1), latency=True)
    shape = RequestShape.from_request(request)
    assert shape.lora == "sql#1"  # the adapter's key: its name and id
    picks = [state.route(i, reports, shape, f"r{i}", T0 + 1)[0].key for i in range(3)]
    assert len(set(picks)) == 1
    # A base-model request is not drawn there: the queue is all it sees.
    base = RequestShape.from_request(replace(request, lora=None))
    assert base.lora is None
    assert state.route(9, reports, base, "r9", T0 + 1)[0].key != picks[0]


def test_a_replica_holding_another_id_of_the_name_does_not_hold_the_adapter() -> None:
    """Adapters are keyed by name and id: a replica that reports ``sql#1`` would load ``sql#2``
    (the name loaded again from other weights), so it is no warmer for it than any other."""
    old = stats(adapters=("sql#1",))
    assert holds_adapter(old, [], "sql#1")
    assert not holds_adapter(old, [], "sql#2")
    assert not holds_adapter(stats(), charges(1, at=T0, lora="sql#1"), "sql#2")
    loads = [ReplicaLoad("old", old), ReplicaLoad("new", stats(adapters=("sql#2",)))]
    for seed in range(10):
        assert first(loads, lora="sql#2", seed=seed) == "new"
        assert first(loads, lora="sql#1", seed=seed) == "old"


def test_balance_overrides_adapter_affinity() -> None:
    """The warm replica wins on its adapter while the replicas are balanced; once it holds far
    more requests from this router than the other, load alone decides."""
    warm = stats(adapters=("sql",), waiting_blocks=4, waiting=1)  # 64 positions ahead
    balanced = [ReplicaLoad("warm", warm, charges(3, at=T0 - 1)),
                ReplicaLoad("cold", stats(), charges(2, at=T0 - 1))]
    piled = [ReplicaLoad("warm", warm, charges(40, at=T0 - 1)),
             ReplicaLoad("cold", stats(), charges(2, at=T0 - 1))]
    for seed in range(10):
        assert first(balanced, seed=seed) == "warm"
        assert first(piled, seed=seed) == "cold"
        assert first(piled, latency=False, seed=seed) == "cold"


def test_a_replica_without_lora_ranks_last_for_an_adapter() -> None:
    loads = [ReplicaLoad("off", stats(free=99, max_loras=0)),
             ReplicaLoad("dead", replace(stats(), alive=0)),
             ReplicaLoad("cold", stats(free=10)),
             ReplicaLoad("warm", stats(free=10, adapters=("sql",)))]
    for latency in (True, False):
        assert order(loads, latency=latency)[1:] == ["cold", "dead", "off"]
        assert order(loads, latency=latency)[0] == "warm"
    # For the base model it is a replica like any other (the one with most free blocks here).
    assert order(loads, lora=None)[0] == "off"
    assert order(loads, lora=None, latency=False)[-1] == "dead"
    # A replica without a report is not known to refuse adapters: it is not ranked last.
    assert order([ReplicaLoad("off", stats(max_loras=0)), ReplicaLoad("new", None)]) == [
        "new", "off"]


def test_base_requests_rank_as_without_adapters() -> None:
    """The same replicas with and without adapter fields in their reports and charges give a
    base-model request the same ranking, draw for draw."""
    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(2, 5)
        plain: list[ReplicaLoad[int]] = []
        with_lora: list[ReplicaLoad[int]] = []
        for k in range(n):
            s = RoutingStats(free_blocks=rng.randint(0, 100), total_blocks=100, block_size=16,
                             waiting=rng.randint(0, 10), report_time=T0,
                             waiting_blocks=rng.randint(0, 30),
                             committed_blocks=rng.randint(0, 100))
            cs = [Charge(rng.randint(1, 4), T0 + rng.choice((-1, 1)), rng.randint(0, 8),
                         rng.randint(0, 40)) for _ in range(rng.randint(0, 20))]
            adapters = tuple(rng.sample(["a", "b", "c"], rng.randint(0, 3)))
            plain.append(ReplicaLoad(k, s, cs, rng.randint(0, 2)))
            with_lora.append(ReplicaLoad(
                k, replace(s, lora_adapters=adapters, max_loras=rng.randint(0, 2)),
                [replace(c, lora=rng.choice((None, "a", "b"))) for c in cs], plain[-1].prefix_hits))
        shape = RequestShape(rng.randint(1, 200), rng.randint(0, 64),
                             latency=rng.random() < 0.5, prefix=(1, 2, 3))
        got = [r.key for r in rank_replicas(with_lora, shape, random.Random(trial))]
        assert got == [r.key for r in rank_replicas(plain, shape, random.Random(trial))]


def test_max_loras_round_trips_and_defaults_to_off() -> None:
    s = stats(adapters=("sql",), max_loras=3)
    assert RoutingStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    old = {"free_blocks": 3, "total_blocks": 8, "block_size": 16, "report_time": 5}
    parsed = RoutingStats.from_dict(old)
    assert parsed is not None and parsed.max_loras == 0
    with pytest.raises(ValueError, match="max_loras"):
        RoutingStats.from_dict({**old, "max_loras": "2"})


def test_bad_adapter_load_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="adapter_load_tokens"):
        Affinity(adapter_load_tokens=-1)
    with pytest.raises(ValueError, match="adapter_load_tokens"):
        RouterSettings.from_kwargs({"adapter_load_tokens": -5})
    assert RouterSettings.from_kwargs({"adapter_load_tokens": 0}).affinity().adapter_load_tokens == 0


def test_a_request_taken_elsewhere_is_recharged_with_its_adapter() -> None:
    state: RouterState[str] = RouterState(RouterSettings(seed=0))
    reports = [("a", stats()), ("b", stats())]
    shape = RequestShape(31, 8, latency=True, lora="sql")
    ranked_first = state.route("k", reports, shape, "r1", T0 + 1)[0].key
    other = "b" if ranked_first == "a" else "a"
    state.routed("k", other, "r1", T0 + 2, stats(), lambda: shape)
    assert [c.lora for c in state.ledger.charges(other)] == ["sql"]
    assert state.ledger.charges(ranked_first) == []
