"""The tiers' promise at small scale, on a live cluster: flow control at the ingress holds what no
replica can start, sheds the lowest tier first (429 with ``Retry-After``, by capacity and late
requests under newer demand), never refuses the top tier while a lower one is held, and loses
nothing.

The ``flow`` app: one replica running at most 2 requests; a dispatch window of 2 (batch may use
1 of it, standard 1, interactive 2); batch holds at most 2 requests, late after 3 s. Two long
interactive streams take both running seats; a standard request is dispatched and waits at the
replica (the window's standard share is then used up); batch requests are held, the third is
refused at once; the held two outlive late_after_s and are still held (nothing newer waits);
a newer batch request then takes a late one's place and the other is shed as well; an
interactive request still goes through. When the streams hang up, everything accepted completes
and every KV block is free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.helpers import KEYS, MODEL, LocalServe, ServeApp, app_config, headers

pytestmark = [pytest.mark.ray, pytest.mark.slow]

C = "/v1/completions"
SHORT = {"model": MODEL, "prompt": "short", "max_tokens": 4, "ignore_eos": True}
HOLD = {"model": MODEL, "prompt": "hold", "max_tokens": 2000, "ignore_eos": True, "stream": True}
ENGINE = {"num_kv_blocks": 300, "kv_cache_memory_bytes": None, "max_num_seqs": 2,
          "max_waiting": 16, "deterministic": True, "device": "cpu"}


@pytest.fixture(scope="module")
def flow_app(local_serve: LocalServe) -> Iterator[ServeApp]:
    config = app_config("flow", "/flow", ENGINE, {
        "anonymous_tier": None, "max_tokens_limit": 2048,
        "flow": {"enabled": True, "starting_per_replica": 2, "max_held": 16}},
        {"LLMServer": {"num_replicas": 1}})
    for tier in config["args"]["tiers"]:
        if tier["name"] == "batch":
            tier.update(max_held=2, late_after_s=3.0)
        if tier["name"] == "interactive":
            tier.update(late_after_s=1.0)
    with local_serve.app("flow", config) as app:
        yield app


async def first_event(client: httpx.AsyncClient, key: str) -> tuple[Any, Any]:
    """Open a long stream and read up to its first event; returns (context, lines)."""
    ctx = client.stream("POST", C, json=HOLD, headers=headers(key))
    response = await ctx.__aenter__()
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            break
    return ctx, lines


async def fill(app: ServeApp, client: httpx.AsyncClient) -> tuple[list[Any], Any]:
    """Two long interactive streams in both running seats, then a standard request waiting at
    the replica (the window's batch share is used up: batch requests are held)."""
    holders = [await first_event(client, KEYS["interactive"]) for _ in range(2)]
    await asyncio.to_thread(app.wait_stats, "2 running",
                            lambda s: next(iter(s.values()))["running"] == 2)
    standard = asyncio.create_task(client.post(C, json=SHORT,
                                               headers=headers(KEYS["standard"])))
    await asyncio.to_thread(app.wait_stats, "the standard request waiting",
                            lambda s: next(iter(s.values()))["waiting"] == 1)
    return holders, standard


async def scenario(app: ServeApp) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120, limits=limits) as client:
        holders, standard = await fill(app, client)
        held = [asyncio.create_task(client.post(C, json=SHORT, headers=headers(KEYS["batch"])))
                for _ in range(2)]
        await asyncio.sleep(0.5)
        out["refused"] = await client.post(C, json=SHORT, headers=headers(KEYS["batch"]))
        top = asyncio.create_task(client.post(C, json=SHORT,
                                              headers=headers(KEYS["interactive"])))
        await asyncio.sleep(4.0)  # past late_after_s: late, not shed
        out["late_kept"] = not any(t.done() for t in held)
        newer = asyncio.create_task(client.post(C, json=SHORT, headers=headers(KEYS["batch"])))
        out["held"] = await asyncio.gather(*held)
        out["top_pending_while_held"] = not top.done()
        for ctx, _ in holders:
            await ctx.__aexit__(None, None, None)
        out["standard"] = await standard
        out["top"] = await top
        out["newer"] = await newer
    return out


def test_flow_control_sheds_batch_first_and_loses_nothing(flow_app: ServeApp) -> None:
    out = asyncio.run(scenario(flow_app))
    refused = out["refused"]
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "shed" and "batch" in error["message"]
    assert "max_held" in error["message"]
    assert out["late_kept"]
    for r in out["held"]:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "shed" and "late" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60
    assert out["newer"].status_code == 200, out["newer"].text
    # The interactive request was never refused: it waited for a seat, then completed.
    assert out["top_pending_while_held"]
    assert out["top"].status_code == 200, out["top"].text
    assert out["standard"].status_code == 200, out["standard"].text
    assert out["top"].json()["usage"]["completion_tokens"] == 4
    flow_app.wait_idle()


async def burst_with_the_sdk(app: ServeApp, n: int) -> list[tuple[Any, float]]:
    """``n`` interactive completions at once through the ``openai`` SDK, without its retries
    (a 429 would show); each (outcome, seconds)."""
    client = openai.AsyncOpenAI(base_url=app.url("/v1"), api_key=KEYS["interactive"],
                                max_retries=0, timeout=300)

    async def one(i: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        try:
            out: Any = await client.completions.create(
                model=MODEL, prompt=f"burst {i}", max_tokens=200,
                extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            out = e
        return out, time.perf_counter() - t0

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def test_a_burst_with_nothing_behind_it_is_served_in_full(flow_app: ServeApp) -> None:
    """16 requests at once (the app holds at most 16) on a replica that runs 2 at a time: most
    are held well past the interactive tier's late_after_s (1 s here), nothing newer arrives,
    so every one is served (before, each was shed once held 1 s)."""
    results = asyncio.run(burst_with_the_sdk(flow_app, 16))
    refused = [o for o, _ in results if isinstance(o, Exception)]
    assert not refused, refused[:3]
    assert all(o.usage.completion_tokens == 200 for o, _ in results)
    assert max(s for _, s in results) > 2.0  # some were held past late_after_s: the test bites
    flow_app.wait_idle()


async def leave_while_held(app: ServeApp) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120, limits=limits) as client:
        holders, standard = await fill(app, client)
        # Batch holds at most 2: a request whose client gives up while held...
        with pytest.raises(httpx.ReadTimeout):
            await client.post(C, json=SHORT, headers=headers(KEYS["batch"]), timeout=1.0)
        await asyncio.sleep(0.5)
        # ...no longer takes a place: two more are both held, neither refused.
        two = [asyncio.create_task(client.post(C, json=SHORT, headers=headers(KEYS["batch"])))
               for _ in range(2)]
        await asyncio.sleep(1.0)
        out["both_held"] = not any(t.done() for t in two)
        for ctx, _ in holders:
            await ctx.__aexit__(None, None, None)
        out["two"] = await asyncio.gather(*two)
        out["standard"] = await standard
    return out


def test_a_held_request_whose_client_left_is_dropped(flow_app: ServeApp) -> None:
    out = asyncio.run(leave_while_held(flow_app))
    assert out["both_held"]
    assert [r.status_code for r in out["two"]] == [200, 200], [r.text for r in out["two"]]
    assert out["standard"].status_code == 200
    flow_app.wait_idle()
