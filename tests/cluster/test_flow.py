"""The tiers' promise at small scale, on a live cluster: flow control at the ingress holds what no
replica can start, sheds the lowest tier first (429 with ``Retry-After``, by capacity and by TTL),
never refuses the top tier while a lower one is held, and loses nothing.

The ``flow`` app: one replica running at most 2 requests; a dispatch window of 2 (batch may use
1 of it, standard 1, interactive 2); batch holds at most 2 requests for at most 3 s. Two long
interactive streams take both running seats; a standard request is dispatched and waits at the
replica (the window's standard share is then used up); batch requests are held, the third is
refused at once, the held two are shed when their TTL runs out; an interactive request still goes
through. When the streams hang up, everything accepted completes and every KV block is free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
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
        "default_tier": None, "max_tokens_limit": 2048,
        "flow": {"enabled": True, "starting_per_replica": 2, "max_held": 16}},
        {"LLMServer": {"num_replicas": 1}})
    for tier in config["args"]["tiers"]:
        if tier["name"] == "batch":
            tier.update(max_held=2, held_ttl_s=3.0)
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


async def scenario(app: ServeApp) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120, limits=limits) as client:
        holders = [await first_event(client, KEYS["interactive"]) for _ in range(2)]
        await asyncio.to_thread(app.wait_stats, "2 running",
                                lambda s: next(iter(s.values()))["running"] == 2)
        standard = asyncio.create_task(client.post(C, json=SHORT,
                                                   headers=headers(KEYS["standard"])))
        await asyncio.to_thread(app.wait_stats, "the standard request waiting",
                                lambda s: next(iter(s.values()))["waiting"] == 1)
        held = [asyncio.create_task(client.post(C, json=SHORT, headers=headers(KEYS["batch"])))
                for _ in range(2)]
        await asyncio.sleep(0.5)
        out["refused"] = await client.post(C, json=SHORT, headers=headers(KEYS["batch"]))
        top = asyncio.create_task(client.post(C, json=SHORT,
                                              headers=headers(KEYS["interactive"])))
        out["held"] = await asyncio.gather(*held)
        out["top_pending_while_held"] = not top.done()
        for ctx, _ in holders:
            await ctx.__aexit__(None, None, None)
        out["standard"] = await standard
        out["top"] = await top
    return out


def test_flow_control_sheds_batch_first_and_loses_nothing(flow_app: ServeApp) -> None:
    out = asyncio.run(scenario(flow_app))
    refused = out["refused"]
    assert refused.status_code == 429, refused.text
    assert refused.headers.get("retry-after") == "1"
    error = refused.json()["error"]
    assert error["code"] == "shed" and "batch" in error["message"]
    assert "max_held" in error["message"]
    for r in out["held"]:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "shed" and "held_ttl_s" in r.json()["error"]["message"]
        assert r.headers.get("retry-after") == "1"
    # The interactive request was never refused: it waited for a seat, then completed.
    assert out["top_pending_while_held"]
    assert out["top"].status_code == 200, out["top"].text
    assert out["standard"].status_code == 200, out["standard"].text
    assert out["top"].json()["usage"]["completion_tokens"] == 4
    flow_app.wait_idle()
