"""The ingress's flow-control gate: ``tierserve.cluster.flow.FlowQueues`` driven on the ingress's event loop.

A request ``enter``s the gate after validation. It is dispatched at once when nothing of its tier
or above is held and the dispatch window has room for its tier; otherwise it is held until the
pump dispatches it (strict priority between tiers, fair share between the tenants of a tier,
on-time requests before late ones), or shed (its tier's capacity, the whole queue's capacity,
late while newer demand of its tier or above is held, or held past ``flow.max_hold_s``:
``Shed``, answered 429 or 503 with a ``Retry-After`` estimated from how fast the gate has
started requests of its tier and above lately). A client that leaves while held is dropped from
the queue at once.

The hold clock: how long a request has been held counts only while the replicas can take work
(``ready``): a request that arrives before the cluster is ready, or waits while no replica is,
is not made late by that wait.

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
full, a tier's overload queues here, where tiers, tenants and hold times are known, instead of
in the replicas' waiting queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.flow import BandSpec, FlowQueues, Held, Refused
from tierserve.cluster.metrics import IngressMetrics
from tierserve.cluster.tiers import DEFAULT_TENANT, Caller
from tierserve.records import ServingError

log = logging.getLogger("tierserve.ingress")

PUMP_PERIOD_S = 0.05
METRICS_PERIOD_S = 1.0
# Retry-After: from the dispatches of the last RATE_WINDOW_S seconds, over at least
# RATE_FLOOR_S (a first handful dispatched at once is not a rate), at most RETRY_AFTER_MAX_S
# (the openai SDK honours up to 60 s), UNKNOWN_RETRY_S while nothing of the tier or above was
# dispatched in the window.
RATE_WINDOW_S = 30.0
RATE_FLOOR_S = 5.0
RETRY_AFTER_MAX_S = 60
UNKNOWN_RETRY_S = 10


class Shed(ServingError):
    """A request flow control refused or dropped (the API's code ``shed``; 429, or the config's
    ``shed_status``); ``reason`` labels the metric (``band_full``, ``queue_full``, ``late``,
    ...); ``retry_after`` is the seconds after which its tier is likely to start work again."""

    code = "shed"

    def __init__(self, status: int, reason: str, message: str, retry_after: int | None = None
                 ) -> None:
        super().__init__(message, status=status, retry_after=retry_after)
        self.reason = reason


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
    """``replicas``: how many replicas the router sees (sizes the window); ``ready``: whether
    the replicas can take work (runs the hold clock). With several models, each model's
    replicas are their own capacity: the ingress keeps one gate per model (``model``: its
    name, in the gauges; ``policy``: its engine's ``scheduling_policy``, else the config's
    ``engine``'s), so the config's ``flow`` settings (``max_held``, the window) are per model."""

    def __init__(self, cfg: ClusterConfig, metrics: IngressMetrics,
                 replicas: Callable[[], int], ready: Callable[[], bool] = lambda: True,
                 policy: str | None = None, model: str | None = None) -> None:
        self.cfg = cfg.flow
        self.model = model or cfg.model_name
        self.metrics = metrics
        self._replicas = replicas
        self._ready = ready
        self.min_retry_after = cfg.retry_after_s
        tiers = sorted(cfg.tiers, key=lambda t: -t.base_priority)
        self.tiers = tiers
        self.band_of = {t.name: i for i, t in enumerate(tiers)}
        self.queues: FlowQueues[tuple[Ticket, asyncio.Future[Shed | None]]] = FlowQueues(
            [BandSpec(t.name, t.max_held, t.late_after_s) for t in tiers], self.cfg.max_held,
            self.cfg.aging_s, self.cfg.aged_share, self.cfg.tenant_burst_s, self.cfg.max_hold_s)
        # The hold clock (seconds while ready) and the monotonic time it was last advanced.
        self.hold_clock = 0.0
        self._clock_at: float | None = None
        self._dispatched: deque[tuple[float, int]] = deque(maxlen=8192)  # (monotonic, band)
        self.known_tenants = {
            t.name: {name for name, _ in t.all_keys()} | {n.name for n in t.tenants}
            | {DEFAULT_TENANT} for t in tiers}
        self.starting = 0
        self.starting_by = [0] * len(tiers)  # per band
        # Whether a replica admits a higher tier's request ahead of a lower tier's (priority
        # scheduling): then a tier's window counts only its band and those above it.
        self._passes_lower = (policy or cfg.engine.scheduling_policy) == "priority"
        self.replicas = 1
        self._wake: asyncio.Event | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._metrics_at = 0.0

    def tick(self, now: float) -> float:
        """Advance the hold clock to monotonic ``now`` (only while ready); its reading."""
        if self._clock_at is not None and now > self._clock_at:
            ready = True
            with contextlib.suppress(Exception):  # a broken probe never stops the clock
                ready = self._ready()
            if ready:
                self.hold_clock += now - self._clock_at
        self._clock_at = now if self._clock_at is None else max(now, self._clock_at)
        return self.hold_clock

    def retry_after(self, band: int, now: float | None = None) -> int:
        """Seconds after which ``band`` is likely to start work again: the requests held of it
        and the bands above it, one more, at the rate the gate dispatched those bands over the
        last ``RATE_WINDOW_S``; at least ``retry_after_s``, at most ``RETRY_AFTER_MAX_S``."""
        now = time.monotonic() if now is None else now
        while self._dispatched and self._dispatched[0][0] < now - RATE_WINDOW_S:
            self._dispatched.popleft()
        started = [t for t, b in self._dispatched if b <= band]
        low = max(self.min_retry_after, 1)
        if not started:
            return max(low, min(UNKNOWN_RETRY_S, RETRY_AFTER_MAX_S))
        rate = len(started) / max(now - started[0], RATE_FLOOR_S)
        ahead = sum(self.queues.on_time(b) for b in range(band + 1)) + 1
        return max(low, min(math.ceil(ahead / rate), RETRY_AFTER_MAX_S))

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
        wall = time.monotonic()
        held = Held(band, tenant, caller.weight, self.tick(wall), (ticket, fut), entered=wall)
        try:
            evicted = self.queues.push(held)
        except Refused as e:
            raise self._shed(band, e.reason, str(e)) from None
        for victim in evicted:
            if victim.late:
                self._drop(victim, "late", "it was late, and a newer request took its place in "
                                           "the ingress's full queue")
            else:
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
        self._dispatched.append((time.monotonic(), ticket.band))
        ticket.starting = True
        self.starting += 1
        self.starting_by[ticket.band] += 1
        self.charge(ticket, ticket.prompt_tokens)

    def _shed(self, band: int, reason: str, why: str) -> Shed:
        tier = self.tiers[band].name
        with contextlib.suppress(Exception):  # a metric never fails a request
            self.metrics.shed(tier, reason)
        retry = self.retry_after(band)
        return Shed(self.cfg.shed_status, reason,
                    f"the server is overloaded: tier {tier!r} shed this request ({why}); retry "
                    f"in about {retry} s", retry)

    def _drop(self, held: Held[tuple[Ticket, asyncio.Future[Shed | None]]], reason: str,
              why: str) -> None:
        ticket, fut = held.item
        if not fut.done():
            fut.set_result(self._shed(ticket.band, reason, why))

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
        """Shed what is overdue, dispatch what the window allows, refresh the gauges
        (``now``: monotonic)."""
        if now - self._metrics_at >= METRICS_PERIOD_S:
            self._metrics_at = now
            with contextlib.suppress(Exception):
                self.replicas = max(self._replicas(), 1)
            with contextlib.suppress(Exception):  # a metric never stops the pump
                self.metrics.flow(
                    {t.name: self.queues.held(i) for i, t in enumerate(self.tiers)},
                    self.starting, self.window(), self.model)
            self.queues.forget_idle()
        clock = self.tick(now)
        for held, reason in self.queues.overdue(clock, now):
            spec = self.tiers[held.band]
            if reason == "max_hold":
                why = (f"held {self.cfg.max_hold_s:g} s, flow.max_hold_s, while no replica "
                       "could start it")
            else:
                why = (f"held past its tier's late_after_s ({spec.late_after_s:g} s) while "
                       "newer requests of its tier or above kept arriving")
            self._drop(held, reason, why)
        while True:
            nxt = self.queues.pop(self.allowed, clock)
            if nxt is None:
                return
            ticket, fut = nxt.item
            if fut.done():
                continue  # its client left
            fut.set_result(None)
            self._dispatch(ticket)
