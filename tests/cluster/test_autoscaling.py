"""Autoscaling on Serve's autoscaler with tierserve's policy, on the real local Serve cluster.

The app is ``configs/cluster-autoscale.yaml``'s engine deployment (``autoscaling_config`` with
``tierserve.cluster.autoscaling:TierPolicy``) on the embedded test model, with windows of
seconds instead of a minute and a replica that runs two requests at once (so a modest load
queues):

- a load that queues on one replica scales the deployment to two; once it stops, back to one
  after the down window; every request answered in full, every block free at the end;
- a replica taken away while it streams (Serve's graceful shutdown) finishes what it holds;
- a replica killed while it drains loses nothing that had not streamed: its queued request is
  sent again and completes on the other, the one it was streaming ends with a clear error.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.cluster.helpers import LocalServe, ServeApp, app_config, deploy, wait_for
from tests.cluster.test_faults import Outcome, stream_one
from tierserve.cluster.app import POLICY

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENGINE: dict[str, Any] = {"num_kv_blocks": 128, "kv_cache_memory_bytes": None,
                          "max_num_seqs": 2, "max_waiting": 64}
ARGS: dict[str, Any] = {"fault_injection": True, "max_tokens_limit": 1024}
POLICY_KWARGS: dict[str, Any] = {"upscale_after_s": 1, "downscale_after_s": 6,
                                 "waiting_high": 1, "busy_low": 0.95}


def autoscaled(max_replicas: int = 2, min_replicas: int = 1,
               kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = app_config("auto", "/auto", ENGINE, ARGS)
    llm = next(d for d in cfg["deployments"] if d["name"] == "LLMServer")
    llm.pop("num_replicas")
    llm["autoscaling_config"] = {
        "min_replicas": min_replicas, "max_replicas": max_replicas,
        "initial_replicas": min_replicas,
        "metrics_interval_s": 0.5, "look_back_period_s": 2, "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "policy": {"policy_function": POLICY, "policy_kwargs": kwargs or POLICY_KWARGS}}
    llm["graceful_shutdown_timeout_s"] = 60
    llm["graceful_shutdown_wait_loop_s"] = 0.5
    return cfg


@pytest.fixture(scope="module")
def auto(local_serve: LocalServe) -> Iterator[tuple[LocalServe, ServeApp]]:
    with local_serve.app("auto", autoscaled()) as app:
        yield local_serve, app


def replicas_by_state(app: ServeApp) -> dict[str, list[str]]:
    """The engine deployment's replicas (actor names) by Serve's state (RUNNING, STOPPING...)."""
    details = serve.context._get_global_client().get_serve_details()
    deployment = details["applications"][app.name]["deployments"]["LLMServer"]
    out: dict[str, list[str]] = {}
    for r in deployment["replicas"]:
        state = r["state"]
        out.setdefault(getattr(state, "value", str(state)), []).append(r["actor_name"])
    return out


def running(app: ServeApp) -> int:
    return len(replicas_by_state(app).get("RUNNING", []))


async def load(app: ServeApp, seconds: float, concurrency: int,
               max_tokens: int = 48) -> list[Outcome]:
    """``concurrency`` clients, each sending streams back to back for ``seconds``."""
    end = time.monotonic() + seconds

    async def client_loop(c: httpx.AsyncClient, i: int) -> list[Outcome]:
        out = []
        while time.monotonic() < end:
            out.append(await stream_one(c, max_tokens, f"client {i} request {len(out)}"))
        return out

    async with httpx.AsyncClient(base_url=app.base_url, timeout=180) as c:
        per = await asyncio.gather(*(client_loop(c, i) for i in range(concurrency)))
    return [o for outs in per for o in outs]


def complete(outcomes: list[Outcome]) -> None:
    """Each answered in full: to its ``max_tokens`` (``length``), no error event, ``[DONE]``."""
    for o in outcomes:
        assert o.status == 200 and o.done and o.error is None, o
        assert o.finish_reason == "length" and o.tokens >= 1, o


def test_a_queueing_load_scales_up_then_down_and_loses_nothing(
        auto: tuple[LocalServe, ServeApp]) -> None:
    _, app = auto
    assert running(app) == 1
    seen: list[int] = []

    async def watch_while(task: asyncio.Future[list[Outcome]]) -> None:
        while not task.done():
            seen.append(await asyncio.to_thread(running, app))
            await asyncio.sleep(0.5)

    async def go() -> list[Outcome]:
        task = asyncio.ensure_future(load(app, 25.0, concurrency=8))
        await watch_while(task)
        return await task

    outcomes = asyncio.run(go())
    complete(outcomes)
    assert max(seen) == 2, seen  # scaled up, never past max_replicas
    # Load gone: back to one after the down window (and the drain).
    t0 = time.monotonic()
    wait_for("one replica again", lambda: running(app) == 1
             and not replicas_by_state(app).get("STOPPING"), timeout_s=120, every_s=0.5)
    assert time.monotonic() - t0 >= POLICY_KWARGS["downscale_after_s"] - 2
    app.num_replicas = 1
    app.wait_idle()  # every KV block free, nothing queued


def test_a_replica_taken_away_finishes_what_it_streams(
        auto: tuple[LocalServe, ServeApp]) -> None:
    """Two replicas stream; the config goes to one: the replica Serve stops drains first."""
    ls, app = auto
    deploy_with(ls, autoscaled(max_replicas=2, min_replicas=2))
    wait_for("two replicas", lambda: running(app) == 2, timeout_s=180, every_s=0.5)
    app.num_replicas = 2
    app.wait_ready()
    app.until_every_replica_serves()

    async def go() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=180) as c:
            tasks = [asyncio.create_task(stream_one(c, 900, f"long {i}")) for i in range(4)]
            await asyncio.to_thread(app.wait_stats, "both replicas streaming",
                                    lambda s: all(v["running"] >= 1 for v in s.values()), 60)
            await asyncio.to_thread(deploy_with, ls, autoscaled(max_replicas=1), False)
            await asyncio.to_thread(wait_for, "a replica draining", lambda: replicas_by_state(
                app).get("STOPPING"), 60, 0.05)
            streaming = sum(not t.done() for t in tasks)
            outcomes = await asyncio.gather(*tasks)
            assert streaming >= 1  # the drain began with streams in flight
            return outcomes

    complete(asyncio.run(go()))
    wait_for("one replica", lambda: running(app) == 1 and not replicas_by_state(app).get(
        "STOPPING"), timeout_s=120, every_s=0.5)
    app.num_replicas = 1
    app.wait_idle()


def test_a_replica_killed_while_it_drains_loses_nothing_that_had_not_streamed(
        auto: tuple[LocalServe, ServeApp]) -> None:
    ls, app = auto
    one_at_a_time = dict(ENGINE, max_num_seqs=1)
    cfg = autoscaled(max_replicas=2, min_replicas=2)
    cfg["args"]["engine"].update(one_at_a_time)
    deploy_with(ls, cfg)
    wait_for("two fresh replicas", lambda: running(app) == 2, timeout_s=180, every_s=0.5)
    app.num_replicas = 2
    app.wait_ready()
    app.until_every_replica_serves()

    async def go() -> tuple[list[Outcome], str]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=180) as c:
            tasks = [asyncio.create_task(stream_one(c, 900, f"long {i}")) for i in range(4)]
            await asyncio.to_thread(
                app.wait_stats, "each replica streaming one request and holding one",
                lambda s: all(v["running"] == 1 and v["waiting"] == 1 for v in s.values()), 60)
            smaller = copy.deepcopy(cfg)
            smaller["deployments"] = autoscaled(max_replicas=1)["deployments"]
            await asyncio.to_thread(deploy_with, ls, smaller, False)
            victim = await asyncio.to_thread(
                wait_for, "a replica draining",
                lambda: (replicas_by_state(app).get("STOPPING") or [None])[0], 60, 0.05)
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks), victim

    outcomes, victim = asyncio.run(go())
    errors = [o for o in outcomes if o.error is not None]
    # Only the request the killed replica was streaming fails, with a clear error event; the
    # one it held without a token was sent again and completed on the other replica.
    assert len(errors) == 1, outcomes
    assert errors[0].tokens >= 1 and errors[0].done, errors[0]
    assert errors[0].error is not None
    assert errors[0].error["code"] in ("replica_failed", "replica_unavailable"), errors[0]
    complete([o for o in outcomes if o.error is None])
    wait_for("the killed replica gone", lambda: running(app) == 1 and victim not in {
        n for names in replicas_by_state(app).values() for n in names}, timeout_s=120,
        every_s=0.5)
    app.num_replicas = 1
    app.wait_idle()


def deploy_with(ls: LocalServe, cfg: dict[str, Any], wait: bool = True) -> None:
    """Apply ``cfg`` as the ``auto`` app's config (every app listed, as Serve wants)."""
    ls.configs["auto"] = cfg
    if wait:
        deploy(ls.client, list(ls.configs.values()))
    else:
        from ray.serve.schema import ServeDeploySchema

        ls.client.deploy_apps(ServeDeploySchema.model_validate(
            {"applications": list(ls.configs.values())}))
