"""The ingress's flow-control gate: ``tierserve.cluster.flow.FlowQueues`` driven on the ingress's event loop.

A request ``enter``s the gate after validation. It is dispatched at once when nothing of its tier
or above is held and the dispatch window has room for its tier; otherwise it is held until the
pump dispatches it (strict priority between tiers, fair share between the tenants of a tier), or
shed (its tier's capacity, the whole queue's capacity, its TTL: ``Shed``, answered 429 with
``Retry-After`` or 503). A client that leaves while held is dropped from the queue at once.

The dispatch window: ``starting_per_replica`` times the replicas the router sees. A tier may
dispatch while the requests it counts that were dispatched to a replica and have not answered
their first token yet ("starting") fill less than its ``queue_share`` of the window, so the top
tier always finds room that lower tiers cannot take. Under ``fcfs`` (the engine's
``scheduling_policy``) it counts every starting request. Under priority scheduling it counts
only its own tier's and the tiers' above it: a replica admits a request ahead of the lower
tiers' waiting there (aging aside: one waiting ``aging_steps`` a priority level may catch up),
so those do not delay its first token, and holding it here behind them would. The starting
requests of all tiers together may then pass the window (with the default shares, up to about
1.8 times it: the standard tier's 0.8, then the top tier's whole window). While its window is
full, a tier's overload queues here, where tiers, tenants and TTLs are known, instead of in the
replicas' waiting queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.flow import BandSpec, FlowQueues, Held, Refused
from tierserve.cluster.metrics import IngressMetrics
from tierserve.cluster.tiers import DEFAULT_TENANT, Caller

log = logging.getLogger("tierserve.ingress")

PUMP_PERIOD_S = 0.05
METRICS_PERIOD_S = 1.0


class Shed(Exception):
    """A request flow control refused or dropped; ``reason`` labels the metric."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(eq=False, slots=True)
class Ticket:
    """A request that passed the gate: its band, tenant, and whether it still counts in the
    dispatch window (until its first token, or its end)."""

    band: int
    tier: str
    tenant: str
    label: str  # the tenant as metrics name it (configured tenants; "other" for the rest)
    weight: float
    prompt_tokens: int = 0  # charged to its tenant when dispatched
    starting: bool = False


class FlowGate:
    def __init__(self, cfg: ClusterConfig, metrics: IngressMetrics,
                 replicas: Callable[[], int]) -> None:
        self.cfg = cfg.flow
        self.metrics = metrics
        self._replicas = replicas
        tiers = sorted(cfg.tiers, key=lambda t: -t.base_priority)
        self.tiers = tiers
        self.band_of = {t.name: i for i, t in enumerate(tiers)}
        self.queues: FlowQueues[tuple[Ticket, asyncio.Future[Shed | None]]] = FlowQueues(
            [BandSpec(t.name, t.max_held, t.held_ttl_s) for t in tiers], self.cfg.max_held,
            self.cfg.aging_s, self.cfg.aged_share, self.cfg.tenant_burst_s)
        self.known_tenants = {
            t.name: {name for name, _ in t.all_keys()} | {n.name for n in t.tenants}
            | {DEFAULT_TENANT} for t in tiers}
        self.starting = 0
        self.starting_by = [0] * len(tiers)  # per band
        # Whether a replica admits a higher tier's request ahead of a lower tier's (priority
        # scheduling): then a tier's window counts only its band and those above it.
        self._passes_lower = cfg.engine.scheduling_policy == "priority"
        self.replicas = 1
        self._wake: asyncio.Event | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._metrics_at = 0.0

    def window(self) -> int:
        return self.cfg.starting_per_replica * max(self.replicas, 1)

    def allowed(self, band: int) -> bool:
        """Whether ``band`` may dispatch now: the starting requests it counts (its own and the
        bands above it under priority scheduling, all of them under fcfs) fill less than its
        ``queue_share`` of the window."""
        share = self.tiers[band].queue_share
        counted = sum(self.starting_by[: band + 1]) if self._passes_lower else self.starting
        return counted < max(1, int(self.window() * share))

    # ------------------------------------------------------------------ a request

    async def enter(self, caller: Caller, prompt_tokens: int) -> Ticket:
        """Wait until the request may go to a replica; raises ``Shed``."""
        self._ensure_pump()
        band = self.band_of[caller.tier.name]
        tenant = caller.tenant
        label = tenant if tenant in self.known_tenants[caller.tier.name] else "other"
        ticket = Ticket(band, caller.tier.name, tenant, label, caller.weight, prompt_tokens)
        if not any(self.queues.held(b) for b in range(band + 1)) and self.allowed(band):
            self._dispatch(ticket)
            return ticket
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Shed | None] = loop.create_future()
        held = Held(band, tenant, caller.weight, time.monotonic(), (ticket, fut))
        try:
            evicted = self.queues.push(held)
        except Refused as e:
            raise self._shed(ticket.tier, e.reason, str(e)) from None
        for victim in evicted:
            self._drop(victim, "evicted", "another request took its place in the ingress's "
                                          "full queue: a higher tier's, or one of a tenant "
                                          "holding fewer in this tier")
        assert self._wake is not None
        self._wake.set()
        try:
            outcome = await fut
        except asyncio.CancelledError:  # the client left while held
            self.queues.remove(held)
            if fut.done() and not fut.cancelled() and fut.result() is None:
                self.started(ticket)
            raise
        if outcome is not None:
            raise outcome
        return ticket

    def started(self, ticket: Ticket) -> None:
        """The request's first token came (or it ended): its window slot is free."""
        if ticket.starting:
            ticket.starting = False
            self.starting -= 1
            self.starting_by[ticket.band] -= 1
            if self._wake is not None:
                self._wake.set()

    def charge(self, ticket: Ticket, tokens: int) -> None:
        """Service (prompt or output tokens) the request's tenant received."""
        if tokens > 0:
            self.queues.charge(ticket.band, ticket.tenant, tokens, ticket.weight)
            with contextlib.suppress(Exception):  # a metric never fails a request
                self.metrics.tenant_tokens(ticket.tier, ticket.label, tokens)

    def _dispatch(self, ticket: Ticket) -> None:
        ticket.starting = True
        self.starting += 1
        self.starting_by[ticket.band] += 1
        self.charge(ticket, ticket.prompt_tokens)

    def _shed(self, tier: str, reason: str, why: str) -> Shed:
        with contextlib.suppress(Exception):  # a metric never fails a request
            self.metrics.shed(tier, reason)
        status = self.cfg.shed_status
        return Shed(status, reason, f"the server is overloaded: tier {tier!r} shed this request "
                                    f"({why}); retry later")

    def _drop(self, held: Held[tuple[Ticket, asyncio.Future[Shed | None]]], reason: str,
              why: str) -> None:
        ticket, fut = held.item
        if not fut.done():
            fut.set_result(self._shed(ticket.tier, reason, why))

    # ------------------------------------------------------------------ the pump

    def _ensure_pump(self) -> None:
        if self._pump_task is None or self._pump_task.done():
            self._wake = asyncio.Event()
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PUMP_PERIOD_S)
            self._wake.clear()
            try:
                self.pump_once(time.monotonic())
            except Exception:  # the pump must outlive any one bad step
                log.exception("flow control pump step failed")

    def pump_once(self, now: float) -> None:
        """Shed what outlived its TTL, dispatch what the window allows, refresh the gauges."""
        if now - self._metrics_at >= METRICS_PERIOD_S:
            self._metrics_at = now
            with contextlib.suppress(Exception):
                self.replicas = max(self._replicas(), 1)
            with contextlib.suppress(Exception):  # a metric never stops the pump
                self.metrics.flow(
                    {t.name: self.queues.held(i) for i, t in enumerate(self.tiers)},
                    self.starting, self.window())
            self.queues.forget_idle()
        for held in self.queues.expire(now):
            spec = self.tiers[held.band]
            self._drop(held, "ttl", f"held {spec.held_ttl_s:g} s, its tier's held_ttl_s, while "
                                    "no replica could start it")
        while True:
            nxt = self.queues.pop(self.allowed, now)
            if nxt is None:
                return
            ticket, fut = nxt.item
            if fut.done():
                continue  # its client left
            fut.set_result(None)
            self._dispatch(ticket)
