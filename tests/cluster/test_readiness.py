"""Readiness without Ray: what a census of the engine replicas means (``cluster/readiness.py``),
and that a probe that fails never stops flow control's hold clock for good."""

from __future__ import annotations

import asyncio

import pytest

from tierserve.cluster.readiness import Readiness, ReplicaCensus


def test_ready_once_every_replica_of_the_config_runs_then_while_one_does() -> None:
    r = Readiness(lambda: ReplicaCensus("UPDATING", 0))
    assert not r.judge(ReplicaCensus("UPDATING", 0)).ready
    state = r.judge(ReplicaCensus("UPDATING", 1))  # one of two up: not yet
    assert not state.ready and "still starting" in state.reason and state.running == 1
    assert r.judge(ReplicaCensus("HEALTHY", 2)).ready
    # a replica restarting after a fault: one still takes work, the endpoint stays ready
    assert r.judge(ReplicaCensus("UNHEALTHY", 1)).ready
    state = r.judge(ReplicaCensus("UNHEALTHY", 0))
    assert not state.ready and "no engine replica" in state.reason
    assert r.judge(ReplicaCensus("UPDATING", 1)).ready  # was ready once: one is enough


@pytest.mark.parametrize("status", ["HEALTHY", "UPSCALING", "DOWNSCALING"])
def test_a_settled_deployment_with_a_replica_is_ready(status: str) -> None:
    assert Readiness(lambda: ReplicaCensus(status, 1)).judge(ReplicaCensus(status, 1)).ready


def test_refresh_reads_the_probe_and_a_failing_probe_keeps_the_clock_running() -> None:
    census = {"value": ReplicaCensus("UPDATING", 0)}

    def probe() -> ReplicaCensus:
        value = census["value"]
        if value is None:
            raise ConnectionError("controller unreachable")
        return value

    async def go() -> None:
        r = Readiness(probe)  # type: ignore[arg-type]
        assert not (await r.refresh()).ready and not r.holds_count()
        census["value"] = ReplicaCensus("HEALTHY", 2)
        assert (await r.refresh()).ready and r.holds_count()
        census["value"] = None  # type: ignore[assignment]
        state = await r.refresh()
        assert "controller unreachable" in state.reason and r.holds_count()
    asyncio.run(go())


def test_ready_probes_the_controller_at_most_once_a_period_however_often_asked() -> None:
    calls = []

    def probe() -> ReplicaCensus:
        calls.append(1)
        return ReplicaCensus("HEALTHY", 2)

    async def go() -> None:
        r = Readiness(probe)
        states = [await r.current() for _ in range(50)]
        assert all(s.ready for s in states)
        assert 1 <= len(calls) <= 2  # this caller's one probe, and the watcher's first
    asyncio.run(go())


def test_several_models_are_ready_only_together() -> None:
    from tierserve.cluster.readiness import ReadyState, together

    a, b = ReadyState(True, "ready", 2), ReadyState(False, "no engine replica can take work yet", 0)
    assert together({"a": a}) == a and together({"b": b}) == b  # one model: its own state
    assert together({"a": a, "c": ReadyState(True, "ready", 1)}) == ReadyState(True, "ready", 3)
    both = together({"a": a, "b": b})
    assert not both.ready and both.running == 2
    assert both.reason == ("not every model can take work: model 'b': no engine replica can "
                           "take work yet")
