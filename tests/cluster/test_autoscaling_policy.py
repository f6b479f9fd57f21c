"""The autoscaling policy (``tierserve.cluster.autoscaling``) without Ray: its decisions replayed
on metric traces (a burst, a slow ramp, a flapping load, a KV-only squeeze, the load going away),
its Serve entry point on a context shaped like Serve's, and the replica's side of the report
(``tierserve.replica.load_report``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from tierserve.cluster.autoscaling import (
    DOWN,
    HOLD,
    TRACE_PERIOD_S,
    UP,
    AutoscalePolicyConfig,
    Decision,
    TierPolicy,
    decide,
    reports_of,
)
from tierserve.replica.load_report import LoadReport, LoadWindow, within_targets

TRACES = Path(__file__).parent / "data"


# ---------------------------------------------------------------------- a simulated deployment

def reports_for(load: float, replicas: int) -> list[LoadReport]:
    """What ``replicas`` replicas report under ``load`` (in one replica's capacity): each is busy
    with its share up to full, KV promised grows with it, and past capacity requests wait and
    the top tier misses its targets in proportion to the excess."""
    per = load / replicas
    over = max(per - 1.0, 0.0)
    finished = 10.0 * min(per, 1.0)
    missed = min(finished * over, finished)
    return [LoadReport(kv_committed=min(0.7 * per, 1.5), busy=min(per, 1.0),
                       waiting={"interactive": 8.0 * over, "batch": 0.0},
                       met={"interactive": finished - missed}, missed={"interactive": missed})
            for _ in range(replicas)]


@dataclass
class Replay:
    """Serve around the policy: a decision changes the target at once; a replica it adds runs
    ``start_s`` later and reports from then on; one it removes goes at once; ``lo``/``hi`` are
    the bounds Serve applies."""

    params: AutoscalePolicyConfig
    lo: int = 1
    hi: int = 2
    start_s: float = 15.0
    tick_s: float = 1.0
    target: int = 1
    running: int = 1
    state: dict[str, Any] = field(default_factory=dict)
    timeline: list[tuple[float, int, int, Decision]] = field(default_factory=list)
    _ready_at: list[float] = field(default_factory=list)

    def run(self, load: Callable[[float], float], seconds: float,
            reports: Callable[[float, int], list[LoadReport]] = reports_for) -> None:
        t0 = self.timeline[-1][0] + self.tick_s if self.timeline else 0.0
        steps = int(seconds / self.tick_s)
        for i in range(steps):
            now = t0 + i * self.tick_s
            while self._ready_at and self._ready_at[0] <= now:
                self._ready_at.pop(0)
                self.running += 1
            d, self.state = decide(self.params, self.state, now, self.running, self.target,
                                   reports(load(now), self.running), self.lo, self.hi)
            want = d.replicas
            if want > self.target:
                self._ready_at += [now + self.start_s] * (want - self.target)
            elif want < self.target:
                self.running -= self.target - want
            self.target = want
            self.timeline.append((now, self.target, self.running, d))

    def changes(self) -> list[tuple[float, str, int]]:
        return [(t, d.action, target) for t, target, _, d in self.timeline if d.action != HOLD]

    def first(self, action: str) -> float:
        return next(t for t, a, _ in self.changes() if a == action)


DEFAULT = AutoscalePolicyConfig()


def test_a_burst_scales_up_within_the_sustain_time_and_stays_within_bounds() -> None:
    r = Replay(DEFAULT)
    r.run(lambda t: 0.3 if t < 30 else 1.8, 150)
    assert r.changes() == [(30.0 + DEFAULT.upscale_after_s, UP, 2)]
    assert r.timeline[-1][1:3] == (2, 2)
    # The starting replica has not reported: no second ask meanwhile (and none past max).
    assert all(target <= 2 for _, target, _, _ in r.timeline)
    assert r.timeline[int(30 + DEFAULT.upscale_after_s + 2)][3].reason == "changing"


def test_a_slow_ramp_scales_up_once_when_it_crosses_capacity() -> None:
    r = Replay(DEFAULT)
    r.run(lambda t: 0.2 + 1.4 * t / 300, 300)
    ups = [c for c in r.changes() if c[1] == UP]
    assert len(ups) == 1 and not [c for c in r.changes() if c[1] == DOWN]
    load_then = 0.2 + 1.4 * ups[0][0] / 300
    assert 1.0 < load_then < 1.3, load_then  # past one replica's capacity, not much later


def test_a_flapping_load_does_not_flap_the_replicas() -> None:
    r = Replay(DEFAULT)
    r.run(lambda t: 1.5 if int(t // 20) % 2 == 0 else 0.2, 600)
    assert [a for _, a, _ in r.changes()] == [UP]
    # Once steady low for the downscale window, one replica goes.
    r.run(lambda t: 0.2, 120)
    assert [a for _, a, _ in r.changes()] == [UP, DOWN]
    assert r.timeline[-1][1] == 1


def test_it_scales_down_only_after_the_window_with_room_to_spare() -> None:
    r = Replay(DEFAULT)
    r.run(lambda t: 1.8, 60)
    assert r.target == 2
    stop = r.timeline[-1][0] + 1
    r.run(lambda t: 0.0, 200)
    down = r.first(DOWN)
    assert down - stop == pytest.approx(DEFAULT.downscale_after_s, abs=1.0)
    assert r.target == 1 and r.running == 1
    # Never below min_replicas however idle.
    r.run(lambda t: 0.0, 300)
    assert r.target == 1 and [a for _, a, _ in r.changes()].count(DOWN) == 1


def test_no_room_to_spare_keeps_both_replicas() -> None:
    """1.2 replicas' worth of busy steps: either alone would be past busy_low."""
    r = Replay(DEFAULT)
    r.run(lambda t: 1.8, 40)
    r.run(lambda t: 1.2, 400)
    assert r.target == 2 and [a for _, a, _ in r.changes()] == [UP]


def test_kv_pressure_alone_scales_up_but_a_short_spike_does_not() -> None:
    def kv_only(kv: float) -> Callable[[float, int], list[LoadReport]]:
        return lambda load, n: [LoadReport(kv_committed=kv if load else 0.2, busy=0.5)] * n

    spike = Replay(DEFAULT)
    spike.run(lambda t: 1.0 if 10 <= t < 10 + DEFAULT.upscale_after_s - 1 else 0.0, 60,
              kv_only(0.95))
    assert spike.changes() == []
    held = Replay(DEFAULT)
    held.run(lambda t: 1.0 if t >= 10 else 0.0, 60, kv_only(0.95))
    assert [(a, n) for _, a, n in held.changes()] == [(UP, 2)]
    assert held.timeline[int(10 + DEFAULT.upscale_after_s)][3].reason == "kv_pressure"


@pytest.mark.parametrize("signal, report, reason", [
    ("waiting", LoadReport(kv_committed=0.3, busy=1.0, waiting={"batch": 6}), "waiting"),
    ("preemptions", LoadReport(kv_committed=0.3, busy=1.0, preemptions_per_s=2.0),
     "preemptions"),
    ("misses", LoadReport(kv_committed=0.3, busy=1.0, met={"interactive": 8},
                          missed={"interactive": 2}), "missed_targets"),
])
def test_each_signal_scales_up(signal: str, report: LoadReport, reason: str) -> None:
    r = Replay(DEFAULT)
    r.run(lambda t: 1.0, 30, lambda load, n: [report] * n)
    assert r.changes()[0][1:] == (UP, 2), signal
    assert r.timeline[int(DEFAULT.upscale_after_s)][3].reason == reason


def test_misses_need_enough_requests_and_watch_only_the_named_tiers() -> None:
    few = [LoadReport(kv_committed=0.1, met={"interactive": 1}, missed={"interactive": 2})]
    d, _ = decide(DEFAULT, {"up_since": 0.0}, 100.0, 1, 1, few)
    assert d.action == HOLD  # 3 finished < min_requests
    batch_misses = [LoadReport(kv_committed=0.1, met={"interactive": 10},
                               missed={"batch": 10})]
    watched = AutoscalePolicyConfig(tiers=["interactive"])
    d, _ = decide(watched, {"up_since": 0.0}, 100.0, 1, 1, batch_misses)
    assert d.action == HOLD and d.signals.miss_ratio == 0.0
    d, _ = decide(DEFAULT, {"up_since": 0.0}, 100.0, 1, 1, batch_misses)
    assert (d.action, d.reason) == (UP, "missed_targets")


def test_a_replica_that_has_not_reported_holds_the_decision() -> None:
    hot = [LoadReport(kv_committed=1.2, busy=1.0)]
    d, state = decide(DEFAULT, {"up_since": 0.0}, 100.0, 2, 2, hot)  # 2 running, 1 report
    assert (d.action, d.reason, d.replicas) == (HOLD, "changing", 2)
    d, _ = decide(DEFAULT, state, 101.0, 2, 2, hot * 2)
    assert (d.action, d.replicas) == (UP, 3)


@pytest.mark.parametrize("kwargs, needle", [
    ({"kv_low": 0.9, "kv_high": 0.8}, "kv_low"),
    ({"tiers": []}, "tiers is empty"),
    ({"max_miss_ratio": 1.5}, "max_miss_ratio"),
    ({"upscale_after": 3}, "upscale_after"),
    ({"downscale_after_s": -1}, "downscale_after_s"),
])
def test_bad_parameters_are_refused_by_name(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TierPolicy(**kwargs)


# ---------------------------------------------------------------------- Serve's entry point

@dataclass(frozen=True)
class Point:  # Serve's TimeStampedValue
    timestamp: float
    value: float


def context(running: list[str], raw: dict[str, dict[str, Any]] | None,
            aggregated: dict[str, dict[str, float]] | None = None, *, now: float,
            current: int | None = None, target: int | None = None, lo: int = 1, hi: int = 2,
            state: dict[str, Any] | None = None) -> SimpleNamespace:
    n = len(running)
    return SimpleNamespace(
        deployment_name="LLMServer", app_name="tierserve", running_replicas=running, raw_metrics=raw,
        aggregated_metrics=aggregated, current_time=now,
        current_num_replicas=n if current is None else current,
        target_num_replicas=n if target is None else target,
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state or {})


def test_the_serve_entry_point_reads_the_latest_point_and_keeps_its_state() -> None:
    policy = TierPolicy(upscale_after_s=2.0)
    raw = {"kv_committed": {"r1": [Point(1.0, 0.99), Point(3.0, 0.95), Point(2.0, 0.1)]},
           "busy": {"r1": [Point(3.0, 1.0)]}, "running_requests": {"r1": [Point(3.0, 9)]}}
    n, state = policy(context(["r1"], raw, now=10.0))
    assert n == 1 and state["tierserve_last"] == "kv_pressure"
    assert state["tierserve_decision"]["signals"]["kv"] == pytest.approx(0.95)
    json.dumps(state)  # Serve keeps it: plain data
    n, state = policy(context(["r1"], raw, now=12.0, state=state))
    assert n == 2 and state["tierserve_decision"]["action"] == UP
    # At max_replicas, the policy says so instead of asking for more.
    n, state = policy(context(["r1", "r2"], {k: v | {"r2": v["r1"]} for k, v in raw.items()},
                              now=20.0, hi=2, state=state))
    n, state = policy(context(["r1", "r2"], {k: v | {"r2": v["r1"]} for k, v in raw.items()},
                              now=23.0, hi=2, state=state))
    assert n == 2 and state["tierserve_last"] == "bounds"


def test_the_serve_entry_point_takes_aggregated_values_and_ignores_strangers() -> None:
    policy = TierPolicy()
    agg = {"kv_committed": {"r1": 0.2, "gone": 0.99}, "busy": {"r1": 0.1}}
    n, state = policy(context(["r1"], None, agg, now=5.0))
    assert n == 1 and state["tierserve_decision"]["signals"]["reported"] == 1
    assert reports_of({"running_requests": {"r1": 3.0}}, ["r1"]) == []
    assert reports_of(None, ["r1"]) == []


def test_the_averaged_reports_are_preferred_to_the_latest_points() -> None:
    """Serve's aggregation (a mean over look_back_period_s) is what the policy reads when it
    has it: a queue hovering at a threshold reads as its level."""
    policy = TierPolicy()
    raw = {"kv_committed": {"r1": [Point(1.0, 0.99)]}, "busy": {"r1": [Point(1.0, 1.0)]}}
    agg = {"kv_committed": {"r1": 0.4}, "busy": {"r1": 0.5}}
    _, state = policy(context(["r1"], raw, agg, now=1.0))
    assert state["tierserve_decision"]["signals"]["kv"] == pytest.approx(0.4)


def test_the_trace_records_a_line_a_second_and_every_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.cluster.autoscaling import TRACE_ENV

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    policy = TierPolicy(upscale_after_s=0.0)
    calm = {"kv_committed": {"r1": 0.1}, "busy": {"r1": 0.1}}
    hot = {"kv_committed": {"r1": 0.95}, "busy": {"r1": 1.0}}
    state: dict[str, Any] = {}
    for now, agg in ((0.0, calm), (0.3, calm), (0.6, hot), (1.2, calm), (2.3, calm)):
        _, state = policy(context(["r1"], None, agg, now=now, state=state))
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [(x["t"], x["action"]) for x in lines] == [(0.0, HOLD), (0.6, UP), (2.3, HOLD)]
    assert lines[1]["reports"] == [{"kv_committed": 0.95, "busy": 1.0,
                                    "preemptions_per_s": 0.0}]
    assert lines[1]["reason"] == "kv_pressure" and lines[1]["replicas"] == 2
    trace.unlink()
    trace.mkdir()  # unwritable: the policy goes on without its trace
    assert policy(context(["r1"], None, calm, now=9.0, state=state))[0] == 1
    assert policy.trace is None


def test_the_bounds_hold_at_min_replicas() -> None:
    policy = TierPolicy(downscale_after_s=0.0)
    agg = {"kv_committed": {"a": 0.0, "b": 0.0}, "busy": {"a": 0.0, "b": 0.0}}
    n, _ = policy(context(["a", "b"], None, agg, now=1.0, lo=2, hi=4))
    assert n == 2


# ---------------------------------------------------------------------- a recorded trace

def test_a_recorded_trace_replays_to_the_decisions_the_cluster_took() -> None:
    """A trace recorded by ``python -m benchmarks.autoscale`` (one replica to two and back,
    the default model): what Serve's controller handed the policy, a line a second and one for
    each decision. Replayed through ``decide``, it takes the decisions the cluster took, at the
    same moments (within a line of the trace: the controller calls the policy ten times a
    second, the trace keeps one call a second, so the windows are shortened by that second):
    a second replica once the load rose, none more, one again once the load had stopped for
    the down window."""
    trace = json.loads((TRACES / "autoscale_trace.json").read_text())
    recorded = [(t["t"], t["action"]) for t in trace["ticks"] if t["action"] != HOLD]
    params = AutoscalePolicyConfig(**trace["policy_kwargs"])
    params = params.model_copy(update={
        "upscale_after_s": max(params.upscale_after_s - TRACE_PERIOD_S, 0.0),
        "downscale_after_s": max(params.downscale_after_s - TRACE_PERIOD_S, 0.0)})
    state: dict[str, Any] = {}
    replayed = []
    for tick in trace["ticks"]:
        reports = [LoadReport.parse(r) for r in tick["reports"]]
        d, state = decide(params, state, tick["t"], tick["running"], tick["target"], reports,
                          *trace["bounds"])
        if d.action != HOLD:
            replayed.append((tick["t"], d.action))
    phases = trace["phases"]
    assert [a for _, a in recorded] == [UP, DOWN], recorded
    assert phases["load_start"] <= recorded[0][0] <= phases["load_start"] + 60
    assert recorded[1][0] >= phases["load_stop"] + trace["policy_kwargs"]["downscale_after_s"]
    assert [a for _, a in replayed] == [UP, DOWN], replayed
    for (t_rec, _), (t_rep, _) in zip(recorded, replayed, strict=True):
        assert abs(t_rec - t_rep) <= 1.5 * TRACE_PERIOD_S, (recorded, replayed)


# ---------------------------------------------------------------------- the replica's side

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_load_window_counts_waiting_outcomes_and_rates() -> None:
    clock = Clock()
    w = LoadWindow(block_size=16, window_s=10.0, clock=clock)
    a = w.arrived("interactive", 33)  # 3 blocks
    w.arrived("batch", 16)
    first = w.report(0.4, step_seconds=5.0, preemptions=2)
    assert first.waiting == {"interactive": 1, "batch": 1}
    assert first.waiting_blocks == {"interactive": 3, "batch": 1}
    assert first.busy == 0.0 and first.preemptions_per_s == 0.0  # one sample: no rate yet
    w.answering(a)
    w.answering(a)  # twice (first token, then the end) is harmless
    w.finished("interactive", True)
    clock.t += 4.0
    w.finished("interactive", False)
    r = w.report(0.5, step_seconds=7.0, preemptions=6)
    assert r.waiting == {"batch": 1}
    assert (r.met, r.missed) == ({"interactive": 1}, {"interactive": 1})
    assert r.busy == pytest.approx(0.5) and r.preemptions_per_s == pytest.approx(1.0)
    clock.t += 7.0  # the first outcome is now older than the window
    r = w.report(0.5, step_seconds=7.0, preemptions=6)
    assert (r.met, r.missed) == ({"interactive": 0}, {"interactive": 1})
    assert LoadReport.parse(r.to_dict()) == r
    assert set(r.to_dict()) >= {"kv_committed", "busy", "preemptions_per_s",
                                "waiting.batch", "missed.interactive"}


def test_busy_is_a_share_of_the_window() -> None:
    clock = Clock()
    w = LoadWindow(block_size=16, window_s=10.0, clock=clock)
    for i in range(30):
        w.report(0.0, step_seconds=0.8 * i, preemptions=0)
        clock.t += 1.0
    r = w.report(0.0, step_seconds=0.8 * 30, preemptions=0)
    assert r.busy == pytest.approx(0.8)
    assert math.isclose(LoadReport.parse({"busy": 2.0, "x.y": 1.0, "waiting.": 1}).busy, 2.0)


@pytest.mark.parametrize("ttft, tpot, ttft_target, tpot_target, ok", [
    (1.0, 0.05, 3.0, 0.1, True),
    (3.5, 0.05, 3.0, 0.1, False),
    (1.0, 0.2, 3.0, 0.1, False),
    (1.0, None, 3.0, 0.1, True),   # one token: no TPOT to judge
    (None, None, 3.0, None, False),  # no first token
    (100.0, 9.0, None, None, True),
])
def test_within_targets(ttft: float | None, tpot: float | None, ttft_target: float | None,
                        tpot_target: float | None, ok: bool) -> None:
    assert within_targets(ttft, tpot, ttft_target, tpot_target) is ok


@pytest.mark.parametrize("ttft, tpot, ttft_target, tpot_target, kept", [
    (1.0, 0.05, 3.0, 0.1, (True, True)),
    (None, None, 3.0, 0.1, (False, None)),  # no first token: TTFT missed, TPOT not judged
    (1.0, None, 3.0, 0.1, (True, None)),  # one token
    (4.0, 0.2, None, 0.1, (None, False)),
    (4.0, 0.2, None, None, (None, None)),
])
def test_targets_kept_one_verdict_per_target(
        ttft: float | None, tpot: float | None, ttft_target: float | None,
        tpot_target: float | None, kept: tuple[bool | None, bool | None]) -> None:
    """What the ingress counts as goodput and a replica reports to the autoscaler."""
    from tierserve.records import targets_kept

    assert targets_kept(ttft, tpot, ttft_target, tpot_target) == kept
