"""``FreeKVBlocksRouter``: the Serve adapter around ``router.policy.rank_replicas``.

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
replica that really took it (the charges live in ``router.ledger.InFlightLedger``).
``internal_request_id`` is not unique per call: a handle call made while serving a request
inherits that request's id. Charges are therefore kept as a list per (replica, id), and the
router mixes in ``FIFOMixin``: with Serve's default exact-id matching, concurrent calls that
share an id never get a replica (they hang).

Serve pickles this module by value (see ``router.registry``): keep process-wide state out of it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from router import registry
from router.ledger import InFlightLedger
from router.policy import (
    LATENCY_PRIORITY,
    Ranked,
    RequestShape,
    all_saturated,
    charge_blocks,
    full_blocks,
    rank_replicas,
)
from router.stats import RoutingStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """``request_router_kwargs`` of the deployment's ``request_router_config``."""

    # A replica out of blocks for a request is saturated from this (estimated) queue length on.
    saturation_waiting: int = 8
    # Block size assumed before any replica has reported.
    default_block_tokens: int = 16
    # Requests at or above this priority are ranked for their first token, the others for room
    # and balance (router.policy).
    latency_priority: int = LATENCY_PRIORITY
    # A tentative charge never confirmed by on_request_routed is forgotten after this long.
    tentative_ttl_s: float = 5.0
    # Seed of the random tie-break (None: from the OS).
    seed: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> RouterSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown request_router_kwargs {unknown} for FreeKVBlocksRouter; "
                f"known: {sorted(known)}"
            )
        settings = cls(**kwargs)
        if settings.saturation_waiting < 0:
            raise ValueError(f"saturation_waiting must be >= 0, got {settings.saturation_waiting}")
        if settings.default_block_tokens <= 0:
            raise ValueError(
                f"default_block_tokens must be positive, got {settings.default_block_tokens}"
            )
        if settings.tentative_ttl_s <= 0:
            raise ValueError(f"tentative_ttl_s must be positive, got {settings.tentative_ttl_s}")
        return settings


class FreeKVBlocksRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by their KV pools (``router.policy``): latency-tier requests to the replica
    that can start them soonest, the others where their whole length fits with the least load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Guards our state and Serve's replica set against readers on other threads (saturated()).
        self._lock = threading.RLock()
        self._ledger: InFlightLedger[ReplicaID] = InFlightLedger()
        self._bad_reports: set[ReplicaID] = set()
        self._configure(RouterSettings())
        registry.register(self)

    def _configure(self, settings: RouterSettings) -> None:
        self.settings = settings
        self._rng = random.Random(settings.seed)

    def initialize_state(self, **kwargs: Any) -> None:
        with self._lock:
            self._configure(RouterSettings.from_kwargs(kwargs))

    # ------------------------------------------------------------------ ranking

    def _stats(self, replica: RunningReplica) -> RoutingStats | None:
        try:
            return RoutingStats.from_dict(replica.routing_stats)
        except ValueError as e:
            if replica.replica_id not in self._bad_reports:
                self._bad_reports.add(replica.replica_id)
                logger.warning("ignoring routing stats of %s: %s", replica.replica_id, e)
            return None

    def rank(
        self, candidates: list[RunningReplica], request: RequestShape, skip: int | None = None
    ) -> list[Ranked[ReplicaID]]:
        """The policy's ranking of ``candidates`` given this router's outstanding charges."""
        with self._lock:
            loads = self._ledger.loads(((r.replica_id, self._stats(r)) for r in candidates), skip)
            return rank_replicas(
                loads,
                request,
                self._rng,
                saturation_waiting=self.settings.saturation_waiting,
                default_block_tokens=self.settings.default_block_tokens,
                latency_priority=self.settings.latency_priority,
            )

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
        request = RequestShape.from_call(pending_request.args, pending_request.kwargs)
        key = id(pending_request)
        now = time.time()
        with self._lock:
            self._expire_tentative(now)
            ranked = self.rank(candidate_replicas, request, skip=key)
            if ranked:
                self._ledger.charge_tentatively(
                    key,
                    ranked[0],
                    pending_request.metadata.internal_request_id,
                    now,
                    holder=pending_request,
                )
        return [[by_id[r.key]] for r in ranked]

    def _expire_tentative(self, now: float) -> None:
        self._ledger.expire(now, self.settings.tentative_ttl_s)

    def saturated(self, request: RequestShape) -> bool:
        """True when every replica that could ever hold ``request`` is saturated (any thread)."""
        with self._lock:
            return all_saturated(self.rank(list(self._replicas.values()), request))

    def outstanding(self) -> dict[ReplicaID, int]:
        """Blocks charged per replica, confirmed and tentative (for tests and tools)."""
        with self._lock:
            return {r: self._ledger.outstanding_blocks(r) for r in self._replicas}

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
                self._ledger.drop_tentative(key)
                return  # removed meanwhile: nothing to track

            def recharge() -> tuple[int, int]:
                stats = self._stats(replica)
                bt = stats.block_tokens if stats else self.settings.default_block_tokens
                shape = RequestShape.from_call(pending_request.args, pending_request.kwargs)
                return (
                    charge_blocks(shape.prompt_tokens, bt),
                    full_blocks(shape.prompt_tokens, shape.max_tokens, bt),
                )

            self._ledger.confirm(
                key,
                replica_id,
                pending_request.metadata.internal_request_id,
                time.time(),
                recharge,
                holder=pending_request,
            )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            self._ledger.complete(replica_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        with self._lock:
            super().update_replicas(replicas)
            keep = {r.replica_id for r in replicas}
            self._ledger.forget_replicas(keep)
            self._bad_reports &= keep

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        with self._lock:
            super().on_replica_actor_died(replica_id)
            self._ledger.forget_replicas(set(self._replicas))
            self._bad_reports.discard(replica_id)

    def serves(self, app_name: str, deployment_name: str) -> bool:
        return (
            self._deployment_id.app_name == app_name and self._deployment_id.name == deployment_name
        )
