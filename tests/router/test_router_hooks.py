"""FreeKVBlocksRouter's hooks with stand-in replicas: no Ray cluster, called as Serve 2.60 does."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaResult, RunningReplica

from tests.router.helpers import outstanding_blocks
from tierserve.records import GenerateRequest, RoutingStats, SamplingParams
from tierserve.router import registry
from tierserve.router.free_blocks_router import FreeKVBlocksRouter
from tierserve.router.policy import RequestShape

DEPLOYMENT = DeploymentID(name="engine", app_name="app")
RESULT = cast(ReplicaResult, None)  # the router never looks at the result


class FakeReplica:
    """What a RequestRouter reads from a RunningReplica."""

    def __init__(self, name: str, free: int, total: int = 256, **stats: Any) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 1000
        self.node_id = "node"
        self.availability_zone: str | None = None
        self.multiplexed_model_ids: set[str] = set()
        self.report(free, total, **stats)

    def report(self, free: int, total: int = 256, at: float | None = None, **stats: Any) -> None:
        now = time.time() if at is None else at
        self.routing_stats = RoutingStats(free, total, 16, report_time=now, **stats).to_dict()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def metadata(rid: str) -> RequestMetadata:
    return RequestMetadata(request_id="x", internal_request_id=rid, is_streaming=True)


def request(prompt: int = 255, rid: str = "", latency: bool = True) -> PendingRequest:
    """A call with the ingress's record; a latency-tier request by default: ranked by free
    blocks (``tierserve.router.policy``)."""
    sent = GenerateRequest((1,) * prompt, SamplingParams(max_tokens=32), latency=latency)
    return PendingRequest(args=[sent], kwargs={}, metadata=metadata(rid or f"r{id(sent)}"))


Body = Callable[[FreeKVBlocksRouter, list[FakeReplica]], Awaitable[None]]


def run(body: Body, *replicas: FakeReplica, **router_kwargs: Any) -> None:
    async def main() -> None:
        router = FreeKVBlocksRouter(
            deployment_id=DEPLOYMENT,
            handle_source=DeploymentHandleSource.UNKNOWN,
            use_replica_queue_len_cache=True,
        )
        router.initialize_state(**{"seed": 0, **router_kwargs})
        router.update_replicas(cast(list[RunningReplica], list(replicas)))
        await body(router, list(replicas))

    asyncio.run(main())


async def choose(router: FreeKVBlocksRouter, pr: PendingRequest) -> str:
    groups = await router.choose_replicas(list(router.curr_replicas.values()), pr)
    assert all(len(g) == 1 for g in groups)  # one replica per group: the ranking decides
    return str(groups[0][0].replica_id.unique_id)


def outstanding(router: FreeKVBlocksRouter) -> dict[str, int]:
    return {rid.unique_id: blocks for rid, blocks in outstanding_blocks(router).items()}


def test_ranked_groups_best_first_and_backoff_requested() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        pr = request()
        groups = await router.choose_replicas(list(router.curr_replicas.values()), pr)
        assert [g[0].replica_id.unique_id for g in groups] == ["b", "c", "a"]
        assert pr.routing_context.should_backoff  # else Serve retries without sleeping

    run(body, FakeReplica("a", 10), FakeReplica("b", 200), FakeReplica("c", 100))


def test_burst_before_any_confirmation_spreads() -> None:
    # 12 requests of 16 blocks chosen back to back, none confirmed yet: tentative charges spread
    # them the way the estimates say (a: 100, b: 70, c: 55 free), not all onto a.
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        picks = Counter([await choose(router, request()) for _ in range(12)])
        assert picks == {"a": 5, "b": 4, "c": 3}
        assert outstanding(router) == {"a": 80, "b": 64, "c": 48}

    run(body, FakeReplica("a", 100), FakeReplica("b", 70), FakeReplica("c", 55))


def test_routed_moves_the_charge_and_completed_releases_it() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        b = reps[1]
        pr = request()
        assert await choose(router, pr) == "a"
        assert outstanding(router) == {"a": 16, "b": 0}
        router.on_request_routed(pr, b.replica_id, RESULT)  # a was full: Serve took b
        assert outstanding(router) == {"a": 0, "b": 16}
        router.on_request_completed(b.replica_id, pr.metadata.internal_request_id)
        assert outstanding(router) == {"a": 0, "b": 0}

    run(body, FakeReplica("a", 100), FakeReplica("b", 50))


def test_rejected_send_drops_the_tentative_charge() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        pr = request()
        assert await choose(router, pr) == "a"
        router.on_request_completed(reps[0].replica_id, pr.metadata.internal_request_id)
        assert outstanding(router) == {"a": 0}

    run(body, FakeReplica("a", 100))


def test_retry_replaces_its_own_tentative_charge() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        pr = request()
        for _ in range(5):  # Serve calls choose_replicas again after a backoff
            await choose(router, pr)
        assert outstanding(router) == {"a": 16}

    run(body, FakeReplica("a", 100))


def test_calls_sharing_an_internal_request_id_are_counted_separately() -> None:
    # Handle calls made while serving one request inherit its internal_request_id.
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        a = reps[0].replica_id
        p1, p2 = request(rid="same"), request(prompt=31, rid="same")
        for pr in (p1, p2):
            await choose(router, pr)
            router.on_request_routed(pr, a, RESULT)
        assert outstanding(router) == {"a": 18}
        router.on_request_completed(a, "same")
        assert outstanding(router) in ({"a": 2}, {"a": 16})
        router.on_request_completed(a, "same")
        assert outstanding(router) == {"a": 0}

    run(body, FakeReplica("a", 100))


def test_a_newer_report_absorbs_requests_routed_before_it() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        a = reps[0]
        for _ in range(3):  # b has a long prompt waiting: a takes them
            pr = request()
            assert await choose(router, pr) == "a"
            router.on_request_routed(pr, a.replica_id, RESULT)
        # Until a reports again its three requests are counted on top of its last report.
        shape = RequestShape(255, 32, latency=True)
        ranked = {r.key.unique_id: r for r in router.rank(list(router.curr_replicas.values()),
                                                          shape)}
        assert (ranked["a"].est_free, ranked["a"].pending) == (100 - 48, 48)
        a.report(free=52, at=time.time() + 1)  # the snapshot shows the three requests
        router.update_replicas(cast(list[RunningReplica], reps))
        ranked = {r.key.unique_id: r for r in router.rank(list(router.curr_replicas.values()),
                                                          shape)}
        assert (ranked["a"].est_free, ranked["a"].pending) == (52, 0)
        assert (ranked["b"].est_free, ranked["b"].pending) == (60 - 100, 100)

    run(body, FakeReplica("a", 100), FakeReplica("b", 60, waiting=1, waiting_blocks=100))


def test_removed_and_dead_replicas_are_forgotten() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        a, b = reps
        for rep in (a, b):
            pr = request()
            await choose(router, pr)
            router.on_request_routed(pr, rep.replica_id, RESULT)
        router.update_replicas(cast(list[RunningReplica], [b]))
        assert outstanding(router) == {"b": 16}
        assert not router._state.ledger.charges(a.replica_id)
        router.on_replica_actor_died(b.replica_id)
        assert outstanding(router) == {}
        assert not router._state.ledger.confirmed and not router._state.ledger.tentative

    run(body, FakeReplica("a", 100), FakeReplica("b", 90))


def test_unconfirmed_tentative_charges_expire() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        await choose(router, request())  # cancelled before it was sent: never confirmed
        await asyncio.sleep(0.06)
        await choose(router, request())
        assert outstanding(router) == {"a": 16}

    run(body, FakeReplica("a", 100), tentative_ttl_s=0.05)


def test_a_new_replica_takes_traffic_once_it_reports_and_a_burst_only_to_its_room() -> None:
    """Autoscaling adds a replica: until its first report it gets nothing (its pool is not
    known); then a burst of long requests is spread, and what goes to the new, empty replica
    stays within its room (its pool, at every request's full length)."""
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        old, new = reps
        new.routing_stats = {}  # just started
        router.update_replicas(cast(list[RunningReplica], reps))
        assert await choose(router, request()) == "old"
        new.report(64, total=64)
        router.update_replicas(cast(list[RunningReplica], reps))
        sent: Counter[str] = Counter()
        for _ in range(24):
            pr = request(prompt=255, latency=False)  # 16 blocks at its full length + 2 more
            name = await choose(router, pr)
            rep = old if name == "old" else new
            router.on_request_routed(pr, rep.replica_id, RESULT)
            sent[name] += 1
        assert sent["new"] >= 1 and sent["old"] >= 1
        assert sent["new"] * 18 <= 64 + 18, sent  # never beyond its room once it is full

    run(body, FakeReplica("old", 900, total=1000, committed_blocks=100), FakeReplica("new", 0))


def test_a_replica_serve_stops_is_dropped_with_its_charges_and_prefix_entries() -> None:
    """Scaling down: Serve's broadcast of the running set leaves the stopping replica out; the
    router forgets what it sent there and the prefixes it recorded there, and never ranks it."""
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        sent = GenerateRequest((7,) * 64, SamplingParams(max_tokens=8), latency=True,
                               prefix_hashes=(11, 12, 13, 14))
        pr = PendingRequest(args=[sent], kwargs={}, metadata=metadata("p1"))
        name = await choose(router, pr)
        gone = next(r for r in reps if r.replica_id.unique_id == name)
        router.on_request_routed(pr, gone.replica_id, RESULT)
        state = router._state
        assert state.index.size(gone.replica_id) > 0 and state.ledger.charges(gone.replica_id)
        stay = [r for r in reps if r is not gone]
        router.update_replicas(cast(list[RunningReplica], stay))
        assert state.index.size(gone.replica_id) == 0
        assert state.ledger.charges(gone.replica_id) == []
        for _ in range(5):
            assert await choose(router, request()) != name

    run(body, FakeReplica("a", 100), FakeReplica("b", 100))


def test_malformed_report_is_treated_as_no_report() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        reps[0].routing_stats = {"free_blocks": "lots"}
        router.update_replicas(cast(list[RunningReplica], reps))
        assert await choose(router, request()) in ("a", "b")

    run(body, FakeReplica("a", 100), FakeReplica("b", 10))


def test_the_router_is_found_by_its_deployment() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        # Code in the router's process finds it by deployment (older test routers may linger).
        assert router in registry.routers("app", "engine")
        assert router not in registry.routers("app", "other")

    run(body, FakeReplica("a", 100), FakeReplica("b", 100))


def test_unknown_router_kwargs_are_refused() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        with pytest.raises(ValueError, match="unknown request_router_kwargs"):
            router.initialize_state(saturation_wait=3)

    run(body, FakeReplica("a", 100))


def test_choose_without_a_request_ranks_and_charges_nothing() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        groups = await router.choose_replicas(list(router.curr_replicas.values()), None)
        assert [g[0].replica_id.unique_id for g in groups] == ["b", "a"]
        assert outstanding(router) == {"a": 0, "b": 0}

    run(body, FakeReplica("a", 10), FakeReplica("b", 20))


def test_a_call_without_a_generate_request_is_ranked_as_an_empty_request() -> None:
    # Routing never fails on what it cannot read (the replica answers that): the call is charged
    # one block and ranked for room, as a request of no length.
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        pr = PendingRequest(args=[[1] * 255, None], kwargs={"priority": 10},
                            metadata=metadata("untyped"))
        assert await choose(router, pr) == "b"
        assert outstanding(router) == {"a": 0, "b": 1}

    run(body, FakeReplica("a", 64, total=64), FakeReplica("b", 10, total=256))


def test_a_retry_avoids_the_replicas_that_failed_it_while_another_remains() -> None:
    async def body(router: FreeKVBlocksRouter, reps: list[FakeReplica]) -> None:
        def retry(*avoid: str) -> PendingRequest:
            sent = GenerateRequest((1,) * 255, SamplingParams(max_tokens=32), latency=True,
                                   avoid_replicas=avoid)
            return PendingRequest(args=[sent], kwargs={}, metadata=metadata(f"r{id(sent)}"))

        candidates = list(router.curr_replicas.values())
        # b has the most free blocks (its stale report still says alive): avoided, c is next.
        groups = await router.choose_replicas(candidates, retry("b"))
        assert [g[0].replica_id.unique_id for g in groups] == ["c", "a"]
        groups = await router.choose_replicas(candidates, retry("b", "c"))
        assert [g[0].replica_id.unique_id for g in groups] == ["a"]
        # Every replica failed it: the ranking of all (a send somewhere beats none).
        groups = await router.choose_replicas(candidates, retry("a", "b", "c"))
        assert [g[0].replica_id.unique_id for g in groups] == ["b", "c", "a"]

    run(body, FakeReplica("a", 10), FakeReplica("b", 200), FakeReplica("c", 100))
