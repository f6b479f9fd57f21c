"""Readiness: whether the engine replicas can take work, as the ingress's ``GET /ready`` says
and as flow control's hold clock reads it (``tierserve.cluster.gate``).

A replica warms up before Serve counts it as running (``LLMServer.__init__`` runs one request
through its step path: what a first step builds is built then), so a running replica can take
work. The cluster is ready once every replica of the config runs (Serve reports the engine
deployment healthy: as many running as it targets); after that, while at least one runs (a
replica restarting after a fault does not take the whole endpoint out of a load balancer).
With several models (``args.models``) each model's deployment has its own ``Readiness``, and the
application is ready only while every model is (``together``: ``GET /ready`` names the models
that are not). ``GET /health`` stays liveness: the ingress answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tierserve.ingress")

# Serve's deployment states in which every replica it targets is running.
SETTLED = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})
PERIOD_S = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaCensus:
    """What Serve says of the engine deployment: its status and how many replicas run."""

    status: str
    running: int


@dataclass(frozen=True, slots=True)
class ReadyState:
    ready: bool
    reason: str  # what is missing (or "ready")
    running: int = 0


class Readiness:
    """The cluster's readiness from ``probe`` (a blocking call: it runs in a thread, every
    ``PERIOD_S``, while something asks)."""

    def __init__(self, probe: Callable[[], ReplicaCensus]) -> None:
        self._probe = probe
        self.state = ReadyState(False, "no replica reported yet")
        self.ever_ready = False
        self.probe_failed = False
        self._task: asyncio.Task[None] | None = None
        self._read_at: float | None = None  # the loop's time of the last probe

    async def current(self) -> ReadyState:
        """The state, probed at most once a ``PERIOD_S`` however often it is asked (``GET
        /ready`` needs no key: its callers must not drive the controller)."""
        self.ensure()
        now = asyncio.get_running_loop().time()
        if self._read_at is None or now - self._read_at >= PERIOD_S:
            return await self.refresh()
        return self.state

    def judge(self, census: ReplicaCensus) -> ReadyState:
        """The state a census means (and it is remembered: once ready, one running replica
        keeps the cluster ready)."""
        if census.running >= 1 and (self.ever_ready or census.status in SETTLED):
            self.ever_ready = True
            state = ReadyState(True, "ready", census.running)
        elif census.running == 0:
            state = ReadyState(False, "no engine replica can take work yet "
                                      f"(deployment {census.status})")
        else:
            state = ReadyState(False, f"{census.running} engine replica(s) can take work; the "
                                      f"others are still starting (deployment {census.status})",
                               census.running)
        self.state = state
        return state

    def ensure(self) -> None:
        """Start watching (on the running event loop) if not already."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def refresh(self) -> ReadyState:
        self._read_at = asyncio.get_running_loop().time()
        try:
            census = await asyncio.to_thread(self._probe)
        except Exception as e:  # Serve's controller unreachable for a moment
            if not self.probe_failed:
                log.warning("cannot read the engine replicas' state: %s", e)
            self.probe_failed = True
            self.state = ReadyState(self.ever_ready, f"cannot read the replicas' state: {e}",
                                    self.state.running)
            return self.state
        self.probe_failed = False
        return self.judge(census)

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(PERIOD_S)

    def holds_count(self) -> bool:
        """Whether held requests' hold time counts now: the replicas can take work, or their
        state cannot be read (a broken probe never stops the clock for good)."""
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to watch from
            self.ensure()
        return self.state.ready or self.probe_failed


def together(states: dict[str, ReadyState]) -> ReadyState:
    """The readiness of an application of several models, each on its own engine deployment
    (``states``: each model's, by name): ready while every one is, else naming those that are
    not; ``running``: the running replicas of all of them."""
    running = sum(s.running for s in states.values())
    missing = {name: s for name, s in states.items() if not s.ready}
    if not missing:
        return ReadyState(True, "ready", running)
    if len(states) == 1:
        return next(iter(missing.values()))
    why = "; ".join(f"model {name!r}: {s.reason}" for name, s in missing.items())
    return ReadyState(False, f"not every model can take work: {why}", running)


def serve_census(app_name: str, deployment_name: str) -> ReplicaCensus:
    """The engine deployment's census from Serve's controller (blocking)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    dep = app.deployments.get(deployment_name) if app is not None else None
    if dep is None:
        return ReplicaCensus("MISSING", 0)
    running = sum(n for state, n in dep.replica_states.items()
                  if str(getattr(state, "value", state)) == "RUNNING")
    return ReplicaCensus(str(getattr(dep.status, "value", dep.status)), running)
