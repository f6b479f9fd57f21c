"""Replica faults under load, on an app of two replicas with fault injection on.

- A replica's actor is killed while both replicas stream: requests that had not produced a token
  are sent again and complete on the other replica; requests that were streaming from the dead
  one end with a clear SSE error event and ``[DONE]``; nothing hangs; the other replica loses
  nothing (every block comes back); Serve starts a new replica and traffic reaches it.
- A replica's runner starts raising (``LLMServer.inject_fault``): its requests end with an error
  event instead of hanging, new requests go to the healthy replica (retried if they reached the
  broken one), the failed replica is reported unhealthy and Serve replaces it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.cluster.helpers import MODEL, LocalServe, ServeApp, app_config, sse_events, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENGINE: dict[str, Any] = {"num_kv_blocks": 128, "kv_cache_memory_bytes": None, "max_num_seqs": 3,
                          "max_waiting": 64}
ARGS: dict[str, Any] = {"fault_injection": True, "max_tokens_limit": 512}


@pytest.fixture(scope="module")
def faults_app(local_serve: LocalServe) -> Iterator[ServeApp]:
    with local_serve.app("faults", app_config("faults", "/faults", ENGINE, ARGS,
                                               {"LLMServer": {"num_replicas": 2}})) as app:
        yield app


@dataclass
class Outcome:
    status: int = 0
    tokens: int = 0  # text events seen
    first_at: float = float("nan")  # time.monotonic() of the first text event
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # an SSE error event
    done: bool = False  # saw [DONE]
    body: Any = field(default=None, repr=False)


async def stream_one(client: httpx.AsyncClient, max_tokens: int, prompt: str) -> Outcome:
    out = Outcome()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            out.body = (await response.aread()).decode()
            return out
        lines: list[str] = [line async for line in response.aiter_lines()]
    for event in sse_events(iter(lines)):
        if event == "[DONE]":
            out.done = True
        elif "error" in event:
            out.error = event["error"]
        else:
            choice = event["choices"][0]
            if choice["text"]:
                out.tokens += 1
                if out.tokens == 1:
                    out.first_at = time.monotonic()
            out.finish_reason = choice["finish_reason"] or out.finish_reason
    return out


async def load_with_fault(app: ServeApp, fault: Any, n: int = 24,
                          max_tokens: int = 96) -> tuple[list[Outcome], float]:
    """``n`` streams (a new one every 50 ms); ``fault()`` runs once 8 streams have started."""
    async with httpx.AsyncClient(base_url=app.base_url, timeout=180) as client:
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(stream_one(client, max_tokens, f"request {i}")))
            await asyncio.sleep(0.05)
            if i == n // 3:
                await asyncio.sleep(1.0)  # let the first ones stream
                fault_at = time.monotonic()
                await asyncio.to_thread(fault)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    return outcomes, fault_at


def check_outcomes(outcomes: list[Outcome], fault_at: float, max_tokens: int = 96) -> int:
    """Every request answered: complete, or (only if it was streaming at the fault) a clear
    error event. Returns how many ended with an error event."""
    errors = 0
    for o in outcomes:
        assert o.status == 200, o
        assert o.done, f"a stream ended without [DONE]: {o}"
        if o.error is None:
            assert o.finish_reason == "length" and o.tokens >= 1, o
            continue
        errors += 1
        assert o.error["code"] in ("replica_failed", "replica_unavailable"), o
        assert o.error["message"], o
        # Only a request that was already streaming may fail: the others were sent again.
        assert o.first_at < fault_at + 0.5, o
    print(f"{len(outcomes)} requests: {len(outcomes) - errors} complete, {errors} ended with an "
          f"error event after streaming")
    return errors


def wait_replaced(app: ServeApp, gone: str) -> dict[str, Any]:
    """Until Serve runs ``app.num_replicas`` replicas again, none of them ``gone``, all idle."""
    wait_for("a new replica", lambda: (len(r := app.replicas()) == app.num_replicas
                                       and gone not in r), timeout_s=240, every_s=0.5)
    app.wait_ready()
    return app.replicas()


def spread(app: ServeApp, n: int = 16, timeout_s: float = 90) -> dict[str, int]:
    """Rounds of ``n`` concurrent requests, each of which must complete, until every replica
    has run steps since the first round (or ``timeout_s``); the steps each replica ran.

    A new replica is ranked only once the router has its first routing-stats report (see
    docs/autoscaling.md), which Serve's controller forwards on its own schedule: on a loaded
    machine the first round can come before it, and then goes to the reported replica."""
    before = {k: int(v["steps"]) for k, v in app.replica_stats().items()}

    async def go() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=180) as client:
            return await asyncio.gather(*(stream_one(client, 32, f"after {i}") for i in range(n)))

    deadline = time.monotonic() + timeout_s
    while True:
        outcomes = asyncio.run(go())
        assert all(o.error is None and o.finish_reason == "length" for o in outcomes), outcomes
        after = {k: int(v["steps"]) for k, v in app.replica_stats().items()}
        steps = {k: after[k] - before.get(k, 0) for k in after}
        if all(v > 0 for v in steps.values()) or time.monotonic() > deadline:
            return steps
        time.sleep(1.0)


def test_killing_a_replica_mid_load_loses_nothing_that_had_not_started(
        faults_app: ServeApp) -> None:
    names = list(faults_app.replicas())
    victim = names[0]

    def kill() -> None:
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    outcomes, fault_at = asyncio.run(load_with_fault(faults_app, kill))
    errors = check_outcomes(outcomes, fault_at)
    # Only the dead replica's running requests may fail (queued ones were sent again): at most
    # its max_num_seqs; the other replica's all completed.
    assert errors <= ENGINE["max_num_seqs"], errors
    # Serve replaces the dead replica; the survivor got every block back.
    wait_replaced(faults_app, victim)
    # Traffic reaches the new replica too.
    steps = spread(faults_app)
    assert len(steps) == 2 and all(v > 0 for v in steps.values()), steps


def test_a_failing_runner_marks_the_replica_unhealthy_and_serve_replaces_it(
        faults_app: ServeApp) -> None:
    handle = serve.get_deployment_handle("LLMServer", app_name=faults_app.name)
    broken: list[str] = []

    def fault() -> None:
        broken.append(handle.inject_fault.remote("injected: the GPU fell off the bus")
                      .result(timeout_s=30))

    outcomes, fault_at = asyncio.run(load_with_fault(faults_app, fault))
    assert check_outcomes(outcomes, fault_at) <= ENGINE["max_num_seqs"]
    assert len(broken) == 1 and broken[0].startswith(f"SERVE_REPLICA::{faults_app.name}#"), broken
    # The broken replica reports itself dead to the router, fails its health check and goes.
    wait_replaced(faults_app, broken[0])
    # After: every request succeeds again, on both replicas.
    steps = spread(faults_app)
    assert len(steps) == 2 and all(v > 0 for v in steps.values()), steps


def test_fault_injection_is_refused_unless_configured(main_app: ServeApp) -> None:
    handle = serve.get_deployment_handle("LLMServer", app_name=main_app.name)
    with pytest.raises(Exception, match="fault injection is off"):
        handle.inject_fault.remote().result(timeout_s=30)
