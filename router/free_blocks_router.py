"""``FreeKVBlocksRouter``: the Serve adapter around ``tierserve.router.policy.rank_replicas``.

What the router does, how a deployment configures it, what it reads of the replicas' reports and
of each request, and its limits: docs/router.md.

How Serve 2.60 drives it (all hooks on the handle owner's router event loop, a thread of its own
unless ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``):

- ``choose_replicas`` returns ranked groups. Serve tries the groups in order and, inside a group,
  takes the replica with the shortest queue below its ``max_ongoing_requests``; when no group has
  one, it calls again after a backoff (0.025 s doubling to 0.5 s), but only if
  ``routing_context.should_backoff`` is set, so we always set it (otherwise it spins). We return
  one replica per group: the ranking decides, and a full replica is skipped.
- ``on_request_routed(pending_request, replica_id, result)`` fires once the replica accepted the
  request (the rejection protocol; under Ray Client it never fires).
- ``on_request_completed(replica_id, internal_request_id)`` fires when the call is over (for a
  streaming call, when its stream ends), also for a send the replica rejected.
- ``update_replicas`` (every change of the set, and every new routing-stats report) and
  ``on_replica_actor_died`` keep the replica set.

Between ``choose_replicas`` and ``on_request_routed`` lies a round trip to the replica, and a
burst is routed concurrently in that window. So ``choose_replicas`` charges the request at once,
tentatively, to the replica it ranked first; ``on_request_routed`` moves the charge to the
replica that really took it (the charges live in ``tierserve.router.ledger.InFlightLedger``).
``internal_request_id`` is not unique per call: a handle call made while serving a request
inherits that request's id. Charges are therefore kept as a list per (replica, id), and the
router mixes in ``FIFOMixin``: with Serve's default exact-id matching, concurrent calls that
share an id never get a replica (they hang).

A retry (``GenerateRequest.avoid_replicas`` names the replicas that failed it) is ranked among
the other candidates only, while there are any: a replica whose engine failed keeps reporting
itself alive until its next routing-stats report reaches us.

Serve pickles this module by value (see ``tierserve.router.registry``): keep process-wide state
out of it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tierserve.records import GenerateRequest, RoutingStats
from tierserve.router import registry
from tierserve.router.policy import Ranked, RequestShape
from tierserve.router.routing import RouterSettings, RouterState

__all__ = ["FreeKVBlocksRouter", "RouterSettings"]

logger = logging.getLogger(__name__)


def request_shape(pending_request: PendingRequest) -> RequestShape:
    """The shape of the call's ``GenerateRequest`` (its first argument). A call without one
    never fails routing: it is ranked as an empty request (the replica answers what it cannot
    read)."""
    args = pending_request.args
    if args and isinstance(args[0], GenerateRequest):
        return RequestShape.from_request(args[0])
    return RequestShape(prompt_tokens=0)


def avoiding(
    candidates: list[RunningReplica], pending_request: PendingRequest
) -> list[RunningReplica]:
    """``candidates`` less the replicas the request asks to avoid (``avoid_replicas``: they
    failed it before), unless that leaves none."""
    args = pending_request.args
    if not (args and isinstance(args[0], GenerateRequest) and args[0].avoid_replicas):
        return candidates
    avoid = set(args[0].avoid_replicas)
    others = [r for r in candidates if r.replica_id.unique_id not in avoid]
    return others or candidates


class FreeKVBlocksRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by their KV pools and the prefixes sent to them (``tierserve.router.policy``):
    latency-tier requests to the replica that can start them soonest, the others where their
    whole length fits with the least load, each drawn to a replica that probably has its prompt's
    prefix cached while the replicas stay balanced."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Guards our state and Serve's replica set against readers on other threads.
        self._lock = threading.RLock()
        self._state: RouterState[ReplicaID] = RouterState()
        self._bad_reports: set[ReplicaID] = set()
        registry.register(self)

    @property
    def settings(self) -> RouterSettings:
        return self._state.settings

    def initialize_state(self, **kwargs: Any) -> None:
        with self._lock:
            self._state.configure(RouterSettings.from_kwargs(kwargs))

    # ------------------------------------------------------------------ ranking

    def _stats(self, replica: RunningReplica) -> RoutingStats | None:
        try:
            return RoutingStats.from_dict(replica.routing_stats)
        except ValueError as e:
            if replica.replica_id not in self._bad_reports:
                self._bad_reports.add(replica.replica_id)
                logger.warning("ignoring routing stats of %s: %s", replica.replica_id, e)
            return None

    def _reports(
        self, candidates: list[RunningReplica]
    ) -> list[tuple[ReplicaID, RoutingStats | None]]:
        return [(r.replica_id, self._stats(r)) for r in candidates]

    def rank(
        self, candidates: list[RunningReplica], request: RequestShape, skip: int | None = None
    ) -> list[Ranked[ReplicaID]]:
        """The policy's ranking of ``candidates`` given this router's outstanding charges."""
        with self._lock:
            return self._state.rank(self._reports(candidates), request, skip)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        if pending_request is None:
            ranked = self.rank(candidate_replicas, RequestShape(prompt_tokens=0))
            return [[by_id[r.key]] for r in ranked]

        pending_request.routing_context.should_backoff = True
        request = request_shape(pending_request)
        candidate_replicas = avoiding(candidate_replicas, pending_request)
        with self._lock:
            ranked = self._state.route(
                id(pending_request),
                self._reports(candidate_replicas),
                request,
                pending_request.metadata.internal_request_id,
                time.time(),
                holder=pending_request,
            )
        return [[by_id[r.key]] for r in ranked]

    # ------------------------------------------------------------------ lifecycle hooks

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: ReplicaResult,
    ) -> None:
        key = id(pending_request)
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None:
                self._state.drop(key)
                return  # removed meanwhile: nothing to track
            self._state.routed(
                key,
                replica_id,
                pending_request.metadata.internal_request_id,
                time.time(),
                self._stats(replica),
                lambda: request_shape(pending_request),
                holder=pending_request,
            )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            self._state.completed(replica_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        with self._lock:
            super().update_replicas(replicas)
            keep = {r.replica_id for r in replicas}
            self._state.forget_replicas(keep)
            self._bad_reports &= keep

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        with self._lock:
            super().on_replica_actor_died(replica_id)
            self._state.forget_replicas(set(self._replicas))
            self._bad_reports.discard(replica_id)

    def replica_count(self) -> int:
        """Replicas this router can send to (the ingress sizes its dispatch window by it)."""
        with self._lock:
            return len(self._replicas)

    def serves(self, app_name: str, deployment_name: str) -> bool:
        return (
            self._deployment_id.app_name == app_name and self._deployment_id.name == deployment_name
        )
