"""Autoscaling the engine deployment on KV pressure and tier targets, on Serve's own autoscaler.

``configs/cluster-autoscale.yaml`` gives the ``LLMServer`` deployment an ``autoscaling_config``
whose ``policy`` is ``tierserve.cluster.autoscaling:TierPolicy`` with ``policy_kwargs`` read
as ``AutoscalePolicyConfig``. Serve's controller calls the policy about ten times a second with
an ``AutoscalingContext``; each replica's latest ``record_autoscaling_stats`` report
(``tierserve.replica.load_report``) is in it. The policy is ``decide``: a pure function of the
parameters, its state, the time, the replica counts and the reports (docs/autoscaling.md):

- **up** by one replica once any of these has held for ``upscale_after_s`` without a break:
  more than ``max_miss_ratio`` of the watched tiers' requests finished in the report window
  missed a target (with at least ``min_requests`` of them); the KV pool promised to unfinished
  requests passes ``kv_high`` (mean over the replicas); requests not yet answering pass
  ``waiting_high`` per replica; preemptions pass ``preemptions_high`` per second per replica.
  Not while a replica that Serve is starting has not reported yet.
- **down** by one once, for ``downscale_after_s`` without a break, nothing says up, the
  watched tiers miss at most half of ``max_miss_ratio``, nothing waits, nothing is preempted,
  and one replica fewer would carry today's load with room: KV promised below ``kv_low`` and
  steps busy below ``busy_low`` of the remaining replicas.

The answer stays within Serve's bounds (``min_replicas``, ``max_replicas``). Every decision is
logged when it changes, and exported (``tierserve_autoscale_*``) for the dashboard.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tierserve.replica.load_report import LoadReport

log = logging.getLogger("ray.serve")

HOLD, UP, DOWN = "hold", "up", "down"
TRACE_ENV = "TIERSERVE_AUTOSCALE_TRACE"
"""With this environment variable set (in the controller's environment: the cluster's), the
policy appends what it saw and decided to that file, one JSON line a second (``TRACE_PERIOD_S``)
and one for every decision that changes the replicas:
the recorded traces the tests replay, and ``benchmarks.autoscale``'s timeline."""
TRACE_PERIOD_S = 1.0  # also how often the gauges are refreshed
UP_REASONS = ("missed_targets", "kv_pressure", "waiting", "preemptions")
REASONS = ("steady", "changing", *UP_REASONS, "room_to_spare", "bounds")


class AutoscalePolicyConfig(BaseModel):
    """The policy's parameters (``policy_kwargs``), with defaults sized for the default model on
    a CPU core (see docs/autoscaling.md for each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tiers: list[str] | None = Field(
        default=None,
        description="the tiers whose attainment drives scaling; `null`: every tier with a target")
    max_miss_ratio: float = Field(
        default=0.05, gt=0.0, lt=1.0,
        description="up when more of the watched requests than this missed a target")
    min_requests: int = Field(
        default=5, ge=1,
        description="finished watched requests (all replicas, last 10 s) needed to judge the ratio")
    kv_high: float = Field(
        default=0.9, gt=0.0,
        description="up when the mean promised KV share passes it")
    kv_low: float = Field(
        default=0.5, gt=0.0,
        description="down only if the promised KV spread over one replica fewer stays under it "
                    "(must be below `kv_high`)")
    busy_low: float = Field(
        default=0.6, gt=0.0, le=1.0,
        description="down only if the busy share spread over one replica fewer stays under it")
    waiting_high: float = Field(
        default=4.0, gt=0.0,
        description="up when requests not yet answering, per replica, pass it")
    preemptions_high: float = Field(
        default=0.5, gt=0.0,
        description="up when preemptions per second per replica pass it")
    upscale_after_s: float = Field(
        default=5.0, ge=0.0, le=3600.0,
        description="how long a reason to go up must hold")
    downscale_after_s: float = Field(
        default=60.0, ge=0.0, le=86400.0,
        description="how long the calm must hold before going down")

    @model_validator(mode="after")
    def _hysteresis(self) -> AutoscalePolicyConfig:
        if self.kv_low >= self.kv_high:
            raise ValueError(f"kv_low ({self.kv_low}) must be below kv_high ({self.kv_high}): "
                             "scaling down would undo the scale-up at once")
        if self.tiers is not None and not self.tiers:
            raise ValueError("tiers is empty: name at least one tier, or leave it out (every "
                             "tier with a target)")
        return self


@dataclass(frozen=True, slots=True)
class Signals:
    """The cluster's load, summed over the replicas' reports: ``missed``/``finished``: the
    watched tiers' requests in the report window; ``kv``: the mean share of the pool promised;
    ``busy``: the step loops' busy shares, summed (in replicas' worth); ``waiting``: requests
    not yet answering, all tiers; ``preemptions``: per second, all replicas."""

    replicas: int
    reported: int
    finished: float
    missed: float
    kv: float
    busy: float
    waiting: float
    preemptions: float

    @property
    def miss_ratio(self) -> float | None:
        return self.missed / self.finished if self.finished else None

    @classmethod
    def of(cls, replicas: int, reports: Sequence[LoadReport],
           tiers: Sequence[str] | None) -> Signals:
        def watched(m: Mapping[str, float]) -> float:
            return sum(v for t, v in m.items() if tiers is None or t in tiers)

        n = len(reports)
        missed = sum(watched(r.missed) for r in reports)
        return cls(
            replicas=replicas, reported=n,
            finished=missed + sum(watched(r.met) for r in reports), missed=missed,
            kv=sum(r.kv_committed for r in reports) / n if n else 0.0,
            busy=sum(r.busy for r in reports),
            waiting=sum(sum(r.waiting.values()) for r in reports),
            preemptions=sum(r.preemptions_per_s for r in reports))


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy answers: ``replicas`` (within the bounds ``decide`` was given),
    ``action`` (hold, up or down), ``reason`` (one of ``REASONS``) and what it saw."""

    replicas: int
    action: str
    reason: str
    signals: Signals

    def describe(self) -> str:
        s = self.signals
        ratio = "-" if s.miss_ratio is None else f"{s.miss_ratio:.2f}"
        return (f"{self.action} to {self.replicas} ({self.reason}): replicas {s.replicas} "
                f"({s.reported} reporting), missed {s.missed:g}/{s.finished:g} ({ratio}), "
                f"kv {s.kv:.2f}, busy {s.busy:.2f}, waiting {s.waiting:g}, "
                f"preemptions {s.preemptions:.2f}/s")


def pressure(p: AutoscalePolicyConfig, s: Signals) -> str | None:
    """The first reason to scale up that holds now, or None."""
    per = max(s.reported, 1)
    ratio = s.miss_ratio
    if ratio is not None and s.finished >= p.min_requests and ratio > p.max_miss_ratio:
        return "missed_targets"
    if s.reported and s.kv > p.kv_high:
        return "kv_pressure"
    if s.reported and s.waiting / per > p.waiting_high:
        return "waiting"
    if s.reported and s.preemptions / per > p.preemptions_high:
        return "preemptions"
    return None


def room_to_spare(p: AutoscalePolicyConfig, s: Signals) -> bool:
    """Whether one replica fewer would carry the load with room (see the module docstring)."""
    if s.replicas <= 1 or s.reported < s.replicas:
        return False
    ratio = s.miss_ratio
    if ratio is not None and ratio > p.max_miss_ratio / 2:
        return False
    rest = s.replicas - 1
    return (s.waiting == 0 and s.preemptions == 0
            and s.kv * s.replicas / rest < p.kv_low and s.busy / rest < p.busy_low)


def decide(p: AutoscalePolicyConfig, state: dict[str, Any], now: float, current: int,
           target: int, reports: Sequence[LoadReport], lo: int = 1,
           hi: int = 1 << 30) -> tuple[Decision, dict[str, Any]]:
    """One call of the policy. ``current``: replicas running; ``target``: the replicas Serve is
    already bringing the deployment to; ``reports``: the running replicas' latest reports (one
    that has not reported yet is left out); ``lo``, ``hi``: the bounds (an answer past them
    holds, reason ``bounds``); ``state``: what the last call returned ({} at first). Returns
    the decision and the state for the next call."""
    s = Signals.of(current, reports, p.tiers)
    state = dict(state)
    why = pressure(p, s)
    if why is None:
        state.pop("up_since", None)
    else:
        state.setdefault("up_since", now)
    spare = why is None and room_to_spare(p, s)
    if spare:
        state.setdefault("down_since", now)
    else:
        state.pop("down_since", None)

    if target != current or s.reported < current:
        # A replica is starting or stopping, or has not reported its pool yet: what it will
        # take is not known, so nothing more is asked until it has (no stacked scale-ups).
        decision = Decision(target, HOLD, "changing", s)
    elif why is not None and now - state["up_since"] >= p.upscale_after_s:
        decision = Decision(target + 1, UP, why, s)
        state.pop("up_since", None)
    elif spare and now - state["down_since"] >= p.downscale_after_s:
        decision = Decision(target - 1, DOWN, "room_to_spare", s)
        state.pop("down_since", None)
    else:
        decision = Decision(target, HOLD, "steady" if why is None else why, s)
    bounded = min(max(decision.replicas, lo), hi)
    if bounded != decision.replicas:
        decision = Decision(bounded, HOLD if bounded == target else decision.action, "bounds", s)
    return decision, state


def reports_of(metrics: Mapping[str, Mapping[Any, Any]] | None,
               replicas: Sequence[Any]) -> list[LoadReport]:
    """The reports of ``replicas`` from Serve's per-metric, per-replica mapping (a value, or a
    time series whose latest point is taken); a replica without any of our keys is left out."""
    if not metrics:
        return []
    out = []
    for rid in replicas:
        values: dict[str, float] = {}
        for name, per_replica in metrics.items():
            v = per_replica.get(rid)
            if v is None:
                continue
            if isinstance(v, (int, float)):
                values[name] = float(v)
            elif isinstance(v, Sequence) and v:
                last = max(v, key=lambda point: getattr(point, "timestamp", 0.0))
                values[name] = float(getattr(last, "value", last))
        if values.keys() & {"kv_committed", "busy"}:
            out.append(LoadReport.parse(values))
    return out


class _Exporter:
    """The decisions as gauges from Serve's controller (``ray.util.metrics``: the controller is
    no Serve replica): target replicas, the reason of the last decision (1 for it, 0 for the
    others) and the signals."""

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        from tierserve.replica.metrics import AUTOSCALE_GAUGES

        self.gauges = {name: Gauge(name, description=doc,
                                   tag_keys=("application", "deployment", *tags))
                       for name, (doc, tags) in AUTOSCALE_GAUGES.items()}

    def export(self, application: str, deployment: str, d: Decision) -> None:
        g, tags = self.gauges, {"application": application, "deployment": deployment}
        g["tierserve_autoscale_target_replicas"].set(d.replicas, tags=tags)
        g["tierserve_autoscale_running_replicas"].set(d.signals.replicas, tags=tags)
        for reason in REASONS:
            g["tierserve_autoscale_reason"].set(float(reason == d.reason),
                                                 tags=tags | {"reason": reason})
        s = d.signals
        ratio = s.miss_ratio
        for name, value in (("miss_ratio", ratio or 0.0), ("kv", s.kv), ("busy", s.busy),
                            ("waiting", s.waiting), ("preemptions", s.preemptions)):
            g["tierserve_autoscale_signal"].set(value, tags=tags | {"signal": name})


_exporter: list[_Exporter | None] = []  # one per process (Ray refuses a metric defined twice)


def _export(application: str, deployment: str, d: Decision) -> None:
    if not _exporter:
        try:
            _exporter.append(_Exporter())
        except Exception as e:  # no Ray metrics here (a unit test): decisions are still logged
            log.debug("autoscaling metrics unavailable: %s", e)
            _exporter.append(None)
    if _exporter[0] is not None:
        _exporter[0].export(application, deployment, d)


class TierPolicy:
    """Serve's entry point (``autoscaling_config.policy.policy_function``, a class: Serve builds
    it once with ``policy_kwargs``, so parameters that do not validate are refused when the
    config is applied, then calls it with each ``AutoscalingContext``): ``decide`` on the
    context's running replicas and their reports, the answer clamped to the context's bounds.
    Returns the replicas and the policy state Serve keeps for the next call."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.params = AutoscalePolicyConfig(**policy_kwargs)
        path = os.environ.get(TRACE_ENV)
        self.trace = Path(path) if path else None
        self._traced = self._exported = -math.inf

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        replicas = list(ctx.running_replicas)
        # Each replica's reports averaged over look_back_period_s (Serve's aggregation): a
        # queue that hovers at a threshold reads as its level, not as a flicker.
        metrics = ctx.aggregated_metrics or ctx.raw_metrics
        reports = reports_of(metrics, replicas)
        decision, mine = decide(self.params, state.get("tierserve", {}), ctx.current_time,
                                ctx.current_num_replicas, ctx.target_num_replicas, reports,
                                ctx.capacity_adjusted_min_replicas,
                                ctx.capacity_adjusted_max_replicas)
        if self.trace is not None and (decision.action != HOLD
                                       or ctx.current_time - self._traced >= TRACE_PERIOD_S):
            self._traced = ctx.current_time
            self._record(ctx, reports, decision)
        changed = decision.action != HOLD or state.get("tierserve_last") != decision.reason
        if changed:
            log.info("tierserve autoscaling %s: %s", ctx.deployment_name, decision.describe())
        # Serve calls this about ten times a second, in its control loop: the gauges need a
        # refresh a second (Ray lets one expire after about 20 s), and at once on a change.
        if changed or ctx.current_time - self._exported >= TRACE_PERIOD_S:
            self._exported = ctx.current_time
            _export(str(ctx.app_name or ""), ctx.deployment_name, decision)
        state.update({"tierserve": mine, "tierserve_last": decision.reason,
                      "tierserve_decision": asdict(decision)})
        return decision.replicas, state

    def _record(self, ctx: Any, reports: Sequence[LoadReport], decision: Decision) -> None:
        """One line of the trace: what the policy saw and decided (never fails the call)."""
        assert self.trace is not None
        line = {"t": round(ctx.current_time, 3), "running": ctx.current_num_replicas,
                "target": ctx.target_num_replicas,
                "reports": [{k: round(v, 4) for k, v in r.to_dict().items()} for r in reports],
                "action": decision.action, "reason": decision.reason,
                "replicas": decision.replicas}
        try:
            with self.trace.open("a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            log.warning("tierserve autoscaling: cannot write the trace %s: %s", self.trace, e)
            self.trace = None
