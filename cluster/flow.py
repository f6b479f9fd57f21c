"""Flow control at the ingress: requests held per tier until a replica can start them, tenants of a
tier served fairly, overload shed from the lowest tier first. Pure: no Ray, no asyncio (the
ingress drives it; its unit tests drive it in virtual time).

- **Bands.** One band per tier, in priority order (band 0 is the highest ``base_priority``).
  ``pop`` serves the highest band that has a held request and is allowed to dispatch (strict
  priority between bands).
- **Fairness inside a band** (the Virtual Token Counter): every tenant has a counter of the
  service it received, in tokens (prompt and output) divided by its weight. ``pop`` takes the
  oldest request of the backlogged tenant with the smallest counter. A tenant that was not
  backlogged has its counter lifted, when a request of it arrives, to the band's floor (the
  smallest counter of the backlogged tenants, or the band's virtual time when none is); with
  ``burst_s``, to the highest floor the band had reached ``burst_s`` ago instead: idle time
  banks no more credit than what the band served in the last ``burst_s`` seconds. With
  ``burst_s`` 0 (the plain Virtual Token Counter) a returning tenant takes turns with the
  backlogged ones at once, so a burst of a tenant that asks less than its share over time gets
  only half of a band that a higher band leaves short, and the rest of it can become late;
  with some, it first catches up what it missed while idle in that span. Either way a tenant is
  served only while its counter is not above a backlogged one's, so it never gets more than a
  backlogged tenant plus one request.
- **Aging.** Strict priority alone starves a lower band behind a steady stream above it: a
  request held longer than ``aging_s`` goes ahead of the bands above it, the oldest such first,
  but such aged dispatches are at most ``aged_share`` of all dispatches, so that under overload
  the lower bands still absorb it.
- **Late, not refused.** A request held longer than its tier's ``late_s`` (the config's
  ``late_after_s``) is *late*: it yields its turn to every on-time request of its band, and is
  dispatched once none of its band or above waits (a band's on-time requests, then its late ones,
  then the next band). A late request is shed (``overdue``) only while an on-time request of its
  band or a higher one is held that arrived after it became late: new demand keeps coming, so it
  would wait until the ceiling, and its client hears at once instead. A burst, whose requests all
  arrived before any of them became late, is served in full however long the replicas take to
  start it. ``max_hold_s`` bounds any hold (minutes, not seconds).
- **Capacity.** A band holds at most its tier's ``max_held`` requests, the whole queue
  ``max_held``. A full band sheds a late request of the tenant holding the most, else evicts the
  newest request of the tenant holding the most for a tenant holding fewer, so one tenant's
  flood cannot lock the others out of their tier. When the whole queue is full, a request sheds
  a late request of the lowest band at or below its own, else evicts the newest held request of
  the lowest band below its own; only when there is none is it refused itself.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class Refused(Exception):
    """The request cannot be held; ``reason``: ``band_full`` or ``queue_full``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BandSpec:
    """One tier's flow settings: its name, how many requests it may hold, and after how long a
    held request is late."""

    name: str
    max_held: int
    late_s: float


@dataclass(eq=False, slots=True)
class Held(Generic[T]):
    """One held request: its band, tenant and weight, when it arrived (on the caller's hold
    clock, which may stand still while nothing can be dispatched), the caller's ``item`` (what
    the ingress wakes when it is dispatched or shed), when it arrived on the wall clock
    (``entered``, for ``max_hold_s``; None: the hold clock) and whether it is late."""

    band: int
    tenant: str
    weight: float
    arrival: float
    item: T
    entered: float | None = None
    seq: int = 0
    late: bool = False


Queues = dict[str, deque[Held[T]]]  # tenant -> its held requests, oldest first


@dataclass(slots=True)
class _Band(Generic[T]):
    spec: BandSpec
    queues: Queues[T] = field(default_factory=dict)  # on-time requests of backlogged tenants
    late: Queues[T] = field(default_factory=dict)  # late requests of backlogged tenants
    counters: dict[str, float] = field(default_factory=dict)
    vtime: float = 0.0
    held: int = 0
    # (time, highest floor so far) over the last burst_s seconds (FlowQueues._note); at most
    # 4096 of them (beyond, the oldest go: less credit)
    floors: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=4096))

    def of(self, held: Held[T]) -> Queues[T]:
        return self.late if held.late else self.queues

    def holding(self, tenant: str) -> int:
        return len(self.queues.get(tenant, ())) + len(self.late.get(tenant, ()))

    def backlogged(self) -> set[str]:
        return self.queues.keys() | self.late.keys()


class FlowQueues(Generic[T]):
    """The held requests of every band (see the module docstring)."""

    def __init__(self, bands: Sequence[BandSpec], max_held: int, aging_s: float | None = None,
                 aged_share: float = 0.05, burst_s: float = 0.0,
                 max_hold_s: float | None = None) -> None:
        if not bands:
            raise ValueError("flow control needs at least one band")
        if max_held < 0:
            raise ValueError(f"max_held must be >= 0, got {max_held}")
        if aging_s is not None and aging_s <= 0:
            raise ValueError(f"aging_s must be positive, got {aging_s}")
        if not 0.0 <= aged_share <= 1.0:
            raise ValueError(f"aged_share must be in [0, 1], got {aged_share}")
        if burst_s < 0:
            raise ValueError(f"burst_s must be >= 0, got {burst_s}")
        if max_hold_s is not None and max_hold_s <= 0:
            raise ValueError(f"max_hold_s must be positive, got {max_hold_s}")
        self.aging_s = aging_s
        self.burst_s = burst_s
        self.aged_share = aged_share
        self.max_hold_s = max_hold_s
        # Aged dispatches earn ``aged_share`` of a dispatch each time one is made, up to one:
        # at most that share of any run of dispatches, never a burst.
        self._aged_credit = 0.0
        self._bands: list[_Band[T]] = [_Band(spec) for spec in bands]
        self.max_held = max_held
        self._seq = itertools.count()
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def held(self, band: int) -> int:
        return self._bands[band].held

    def on_time(self, band: int) -> int:
        """The band's held requests that are not late."""
        return sum(len(q) for q in self._bands[band].queues.values())

    def counter(self, band: int, tenant: str) -> float:
        """The tenant's weighted service so far (0 for one never served)."""
        return self._bands[band].counters.get(tenant, 0.0)

    def push(self, held: Held[T]) -> list[Held[T]]:
        """Hold ``held``; returns the requests shed or evicted for it (the caller answers them;
        a late one is marked ``late``). Raises ``Refused`` when it cannot be held."""
        b = self._bands[held.band]
        evicted: list[Held[T]] = []
        if b.held >= b.spec.max_held:
            # A full band is shared fairly: a late request of the tenant holding the most goes
            # first, else the newest request of the tenant holding the most makes room for a
            # tenant holding fewer (a flood cannot lock the others out).
            crowding = self._oldest_late(b)
            if crowding is None:
                mine = b.holding(held.tenant)
                top = max(b.queues, key=b.holding, default=None)
                if top is None or top == held.tenant or b.holding(top) <= mine + 1:
                    raise Refused("band_full", f"tier {b.spec.name!r} already holds {b.held} "
                                               "requests (its max_held)")
                crowding = b.queues[top][-1]
            self.remove(crowding)
            evicted.append(crowding)
        if self._held >= self.max_held:
            victim = self._late_from_lowest(held.band) or self._newest_below(held.band)
            if victim is None:
                raise Refused("queue_full", f"the ingress already holds {self._held} requests "
                                            "(max_held) and none of a lower tier")
            self.remove(victim)
            evicted.append(victim)
        held.seq = next(self._seq)
        held.late = False
        # A request never counts as held longer than one before it of its tenant: each queue
        # stays in arrival order, so what is late or overdue is always a queue's head.
        last = b.queues.get(held.tenant) or b.late.get(held.tenant)
        if last:
            held.arrival = max(held.arrival, last[-1].arrival)
        if held.tenant not in b.queues and held.tenant not in b.late:
            floor = self._floor_at(b, held.arrival - self.burst_s)
            b.counters[held.tenant] = max(b.counters.get(held.tenant, 0.0), floor)
        b.queues.setdefault(held.tenant, deque()).append(held)
        b.held += 1
        self._held += 1
        self._note(b, held.arrival)
        return evicted

    @staticmethod
    def _floor(b: _Band[T]) -> float:
        backlogged = [b.counters.get(t, 0.0) for t in b.backlogged()]
        return min(backlogged) if backlogged else b.vtime

    def _note(self, b: _Band[T], now: float) -> None:
        """Remember how far the band had got at ``now`` (for ``_floor_at``): the highest floor
        so far, which a tenant lifted below the floor cannot pull back (so credit never chains
        from one returning tenant to the next). Samples older than ``burst_s`` are dropped,
        and a time earlier than the last sample's counts as that time."""
        if self.burst_s <= 0:
            return
        h = b.floors
        if h:
            now = max(now, h[-1][0])
        h.append((now, max(self._floor(b), h[-1][1] if h else -math.inf)))
        while h[0][0] < now - self.burst_s:
            h.popleft()

    def _floor_at(self, b: _Band[T], when: float) -> float:
        """Where a tenant back from idle starts: with credit, how far the band had got by
        ``when``, at most: the oldest sample at or after it (the band may have got further
        between samples, unseen: service charged outside a push or a pop takes none, so this
        errs towards less credit, never more), even where a credited tenant still backlogged
        holds the floor lower (its credit is not passed on); the floor now when no sample is
        that recent, or without credit."""
        if self.burst_s > 0:
            for t, f in b.floors:
                if t >= when:
                    return f
        return self._floor(b)

    def _newest_below(self, band: int) -> Held[T] | None:
        for b in reversed(self._bands[band + 1:]):
            newest = max((q[-1] for q in b.queues.values()), key=lambda h: h.seq, default=None)
            if newest is not None:
                return newest
        return None

    @staticmethod
    def _oldest_late(b: _Band[T]) -> Held[T] | None:
        """The oldest late request of the band's tenant holding the most (None: none late)."""
        top = max(b.late, key=b.holding, default=None)
        return None if top is None else b.late[top][0]

    def _late_from_lowest(self, band: int) -> Held[T] | None:
        """A late request of the lowest band at or below ``band`` that has one."""
        for b in reversed(self._bands[band:]):
            victim = self._oldest_late(b)
            if victim is not None:
                return victim
        return None

    def pop(self, allowed: Callable[[int], bool], now: float | None = None) -> Held[T] | None:
        """The next request to dispatch: from the highest band with a held request that
        ``allowed(band)``, its on-time requests before its late ones, the oldest of the
        backlogged tenant with the least service; with ``now``, an aged request of a lower band
        first while aged dispatches are within their share (the module docstring)."""
        aged = self._aged_candidate(allowed, now)
        if aged is not None:
            self._aged_credit -= 1.0
            return self._take(aged.band, aged.tenant, aged.late, now)
        for i, b in enumerate(self._bands):
            if not allowed(i):
                continue
            for late, queues in ((False, b.queues), (True, b.late)):
                if queues:
                    return self._take(i, self._fairest(b, queues), late, now)
        return None

    @staticmethod
    def _fairest(b: _Band[T], queues: Queues[T]) -> str:
        """The tenant of ``queues`` with the least service (the oldest head on a tie)."""
        return min(queues, key=lambda t: (b.counters.get(t, 0.0), queues[t][0].seq))

    def _aged_candidate(self, allowed: Callable[[int], bool],
                        now: float | None) -> Held[T] | None:
        if now is None or self.aging_s is None or self._aged_credit < 1.0:
            return None
        top = next((i for i, b in enumerate(self._bands) if b.held and allowed(i)), None)
        if top is None:
            return None
        oldest = min((q[0] for b in self._bands[top + 1:] for qs in (b.queues, b.late)
                      for q in qs.values()), key=lambda h: h.seq, default=None)
        if oldest is None or now - oldest.arrival < self.aging_s or not allowed(oldest.band):
            return None
        return oldest

    def _take(self, band: int, tenant: str, late: bool, now: float | None = None) -> Held[T]:
        b = self._bands[band]
        queues = b.late if late else b.queues
        q = queues[tenant]
        held = q.popleft()
        if not q:
            del queues[tenant]
        b.vtime = max(b.vtime, b.counters.get(tenant, 0.0))
        b.held -= 1
        self._held -= 1
        self._aged_credit = min(self._aged_credit + self.aged_share, 1.0)
        if now is not None:
            self._note(b, now)
        return held

    def remove(self, held: Held[T]) -> bool:
        """Drop a held request (its client left, or it was shed); False if not held."""
        b = self._bands[held.band]
        queues = b.of(held)
        q = queues.get(held.tenant)
        if q is None:
            return False
        try:
            q.remove(held)
        except ValueError:
            return False
        if not q:
            del queues[held.tenant]
        b.held -= 1
        self._held -= 1
        return True

    def overdue(self, now: float, wall: float | None = None) -> list[tuple[Held[T], str]]:
        """Mark late what was held longer than its band's ``late_s``, and remove and return
        what must be shed now, with why: ``max_hold`` (held longer than ``max_hold_s`` on the
        wall clock ``wall``, or the hold clock without it) or ``late`` (late while an on-time
        request of its band or a higher one, held, arrived after it became late; the module
        docstring). ``now``: the hold clock."""
        out: list[tuple[Held[T], str]] = []
        newest_on_time = -math.inf  # the newest on-time arrival of this band and those above
        for b in self._bands:
            # Queues are in arrival order (``push``): only their heads can be overdue.
            for tenant, q in list(b.queues.items()):
                while q and now - q[0].arrival > b.spec.late_s:
                    h = q.popleft()
                    h.late = True
                    b.late.setdefault(tenant, deque()).append(h)
                if not q:
                    del b.queues[tenant]
            for q in b.queues.values():
                newest_on_time = max(newest_on_time, q[-1].arrival)
            for qs in (b.queues, b.late):
                for q in qs.values():
                    for h in q:
                        held_s = (now - h.arrival if wall is None or h.entered is None
                                  else wall - h.entered)
                        if self.max_hold_s is not None and held_s > self.max_hold_s:
                            out.append((h, "max_hold"))
                        elif h.late and newest_on_time > h.arrival + b.spec.late_s:
                            out.append((h, "late"))
                        else:
                            break  # the rest of this queue arrived later
        for h, _ in out:
            self.remove(h)
        return out

    def charge(self, band: int, tenant: str, tokens: int, weight: float) -> None:
        """Count ``tokens`` of service (prompt or output) to a tenant of ``band``."""
        if tokens > 0:
            b = self._bands[band]
            b.counters[tenant] = b.counters.get(tenant, 0.0) + tokens / weight

    def forget_idle(self, keep: int = 4096) -> None:
        """Bound the counters kept for tenants that hold nothing (header-named tenants can be
        many): beyond ``keep`` per band, the idle ones are dropped (they come back at the
        floor, as any returning tenant does)."""
        for b in self._bands:
            if len(b.counters) > keep:
                backlogged = b.backlogged()
                b.counters = {t: c for t, c in b.counters.items() if t in backlogged}
