"""What a replica tells Serve's autoscaler (``LLMServer.record_autoscaling_stats``).

Serve asks every ``metrics_interval_s`` and hands the numbers, per replica, to the deployment's
policy (``tierserve.cluster.autoscaling.tier_policy``). They are the signals docs/autoscaling.md
names: how much of the KV pool the unfinished requests are promised, how busy the step loop
was, preemptions per second, and per tier the requests not yet answering (with the KV blocks
their prompts need) and, over the last ``WINDOW_S`` seconds, the requests that finished within
or past their tier's targets. A request's time to first token counts from its arrival at the
ingress (``GenerateRequest.waited_s``), so time held at the gate counts against its target.

A report is a flat ``dict[str, float]`` (what Serve accepts): the keys are ``KV``, ``BUSY``,
``PREEMPTIONS``, and ``<field>.<tier>`` for ``WAITING``, ``WAITING_BLOCKS``, ``MET`` and
``MISSED``. ``LoadReport.parse`` reads one back.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tierserve.arith import ceil_div
from tierserve.records import targets_kept

WINDOW_S = 10.0
"""Seconds of finished requests (and of step time and preemptions) a report covers."""

KV, BUSY, PREEMPTIONS = "kv_committed", "busy", "preemptions_per_s"
WAITING, WAITING_BLOCKS, MET, MISSED = "waiting", "waiting_blocks", "met", "missed"
_PER_TIER = (WAITING, WAITING_BLOCKS, MET, MISSED)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One replica's report, parsed. ``kv_committed``: the KV pool's share promised to the
    unfinished requests once they reach their ``max_tokens`` (may pass 1: the waiting ones are
    counted too); ``busy``: the share of the window the step loop spent in steps;
    ``preemptions_per_s``: over the window; per tier: ``waiting`` (requests not yet answering),
    ``waiting_blocks`` (their prompts' blocks), ``met`` and ``missed`` (requests that finished in
    the window within, or past, a target of their tier)."""

    kv_committed: float = 0.0
    busy: float = 0.0
    preemptions_per_s: float = 0.0
    waiting: Mapping[str, float] = field(default_factory=dict)
    waiting_blocks: Mapping[str, float] = field(default_factory=dict)
    met: Mapping[str, float] = field(default_factory=dict)
    missed: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        out = {KV: float(self.kv_committed), BUSY: float(self.busy),
               PREEMPTIONS: float(self.preemptions_per_s)}
        for name in _PER_TIER:
            for tier, v in getattr(self, name).items():
                out[f"{name}.{tier}"] = float(v)
        return out

    @classmethod
    def parse(cls, d: Mapping[str, float]) -> LoadReport:
        """A report from ``to_dict``'s keys; unknown keys (Serve's own, e.g. its running
        requests) are ignored, missing ones read as 0."""
        tiers: dict[str, dict[str, float]] = {name: {} for name in _PER_TIER}
        for key, v in d.items():
            name, dot, tier = key.partition(".")
            if dot and name in tiers and tier:
                tiers[name][tier] = float(v)
        return cls(kv_committed=float(d.get(KV, 0.0)), busy=float(d.get(BUSY, 0.0)),
                   preemptions_per_s=float(d.get(PREEMPTIONS, 0.0)), **tiers)


@dataclass(slots=True)
class _Pending:
    tier: str
    blocks: int


class LoadWindow:
    """The replica's side of the report: requests not yet answering, outcomes in the last
    ``window_s``, and samples of two cumulative counters (step seconds, preemptions) to turn into
    rates. Thread-safe (the step loop's thread and the event loop both touch it)."""

    def __init__(self, block_size: int, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self._outcomes: deque[tuple[float, str, bool]] = deque()
        self._counters: deque[tuple[float, float, float]] = deque()  # (t, step s, preemptions)

    def arrived(self, tier: str, prompt_tokens: int) -> int:
        """A request waiting for its first token; returns its ticket for ``answering``."""
        with self._lock:
            self._next += 1
            self._pending[self._next] = _Pending(tier, ceil_div(prompt_tokens, self.block_size))
            return self._next

    def answering(self, ticket: int) -> None:
        """The ticket's request produced its first token, or ended without one."""
        with self._lock:
            self._pending.pop(ticket, None)

    def finished(self, tier: str, met: bool) -> None:
        """A request of ``tier`` (which has a target) finished, within its targets or not."""
        with self._lock:
            self._outcomes.append((self.clock(), tier, met))

    def report(self, kv_committed: float, step_seconds: float, preemptions: int) -> LoadReport:
        """This moment's report, given the engine's committed-KV share and its cumulative step
        seconds and preemptions (rates over the window: 0 until two samples exist)."""
        now = self.clock()
        with self._lock:
            while self._outcomes and self._outcomes[0][0] < now - self.window_s:
                self._outcomes.popleft()
            self._counters.append((now, step_seconds, float(preemptions)))
            while len(self._counters) > 2 and self._counters[1][0] <= now - self.window_s:
                self._counters.popleft()
            t0, s0, p0 = self._counters[0]
            span = now - t0
            busy = min(max((step_seconds - s0) / span, 0.0), 1.0) if span > 0 else 0.0
            rate = max(preemptions - p0, 0.0) / span if span > 0 else 0.0
            waiting: dict[str, float] = {}
            blocks: dict[str, float] = {}
            for p in self._pending.values():
                waiting[p.tier] = waiting.get(p.tier, 0.0) + 1
                blocks[p.tier] = blocks.get(p.tier, 0.0) + p.blocks
            met: dict[str, float] = {}
            missed: dict[str, float] = {}
            for _, tier, ok in self._outcomes:
                into = met if ok else missed
                into[tier] = into.get(tier, 0.0) + 1
                (missed if ok else met).setdefault(tier, 0.0)
        return LoadReport(kv_committed=kv_committed, busy=busy, preemptions_per_s=rate,
                          waiting=waiting, waiting_blocks=blocks, met=met, missed=missed)


def within_targets(ttft_s: float | None, tpot_s: float | None, ttft_target_s: float | None,
                   tpot_target_s: float | None) -> bool:
    """Whether a finished request kept its tier's targets: a first token (``ttft_s`` None: it
    never produced one) within ``ttft_target_s``, and a time per output token (None: one token,
    nothing to judge) within ``tpot_target_s``; a target of None is always kept
    (``tierserve.records.targets_kept``, both)."""
    return ttft_s is not None and False not in targets_kept(ttft_s, tpot_s, ttft_target_s,
                                                            tpot_target_s)
