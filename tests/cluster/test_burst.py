"""Overload: ten times the sustainable rate for a minute, on an app of two small replicas.

First the sustainable rate is measured (a closed loop of 8 clients for 15 s: the requests
finished per second), then Poisson arrivals at ten times that rate (capped at 40/s) for 60 s,
tiers mixed 10% interactive, 30% standard, 60% batch. What must hold:

- nothing hangs: every request is answered (200, or 429 with ``Retry-After``), and refusals come
  back sooner than accepted requests (median against median: 429s are answered by an admission
  check, not after waiting in a queue; on two shared cores the HTTP layer delays both);
- the queue stays bounded: no replica ever reports more than ``max_waiting`` waiting;
- the lowest tier is refused first: the share of 429s is highest for batch and lowest for
  interactive; the interactive tier's time to first token stays bounded: its p90 over the last
  20 s is at most three times that over the 20 s before, or twice the time the sustainable rate
  takes to serve the ingress's in-flight cap (no growth once the queues are full);
- afterwards the cluster is back at its baseline: nothing waiting or running, every block free,
  and it serves a normal request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from tests.cluster.helpers import KEYS, MODEL, LocalServe, ServeApp, app_config, headers

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_WAITING = 24
ENGINE: dict[str, Any] = {"num_kv_blocks": 96, "kv_cache_memory_bytes": None, "max_num_seqs": 8,
                          "max_waiting": MAX_WAITING}
# The ingress lets at most 96 requests be in flight (batch 48, standard 76): a little more than
# the two replicas run and queue (2 x (8 + 24)), so the HTTP layer holds no long backlog of its
# own (on two cores the client, Serve's proxy and the ingress compete with the engines for CPU).
ARGS: dict[str, Any] = {"max_tokens_limit": 64, "max_inflight_requests": 96}
TIERS = (("interactive", 0.1), ("standard", 0.3), ("batch", 0.6))


@pytest.fixture(scope="module")
def burst_app(local_serve: LocalServe) -> Iterator[ServeApp]:
    with local_serve.app("burst", app_config("burst", "/burst", ENGINE, ARGS,
                                              {"LLMServer": {"num_replicas": 2}})) as app:
        yield app


@dataclass
class Answer:
    tier: str
    at: float = 0.0  # seconds into the burst when it was sent
    status: int = 0
    retry_after: str | None = None
    seconds: float = 0.0
    ttft: float | None = None
    error: str | None = None


async def ask(client: httpx.AsyncClient, tier: str, rng: random.Random, at: float = 0.0) -> Answer:
    out = Answer(tier, at)
    body = {"model": MODEL, "prompt": [rng.randrange(3, 256) for _ in range(rng.randint(16, 64))],
            "max_tokens": rng.randint(16, 48), "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=headers(KEYS[tier])) as r:
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and out.ttft is None:
                        out.ttft = time.perf_counter() - t0
                    if "\"error\"" in line:
                        out.error = line
            else:
                await r.aread()
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - t0
    return out


async def sustainable_rate(app: ServeApp, clients: int = 8, seconds: float = 15.0) -> float:
    rng = random.Random(1)
    done = 0
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
        stop = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                a = await ask(client, "interactive", rng)
                assert a.status == 200 and a.error is None, a
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return done / (time.perf_counter() - t0)


async def overload(app: ServeApp, rate: float, seconds: float
                   ) -> tuple[list[Answer], list[int]]:
    rng = random.Random(2)
    waiting_seen: list[int] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            stats = await asyncio.to_thread(app.replica_stats)
            waiting_seen.extend(int(s["waiting"]) for s in stats.values())
            await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=app.base_url, timeout=300, limits=limits) as client:
        watcher = asyncio.create_task(watch())
        tasks = []
        t0 = time.perf_counter()
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tier = rng.choices([n for n, _ in TIERS], [w for _, w in TIERS])[0]
            tasks.append(asyncio.create_task(ask(client, tier, rng, t)))
        answers = await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
        stop.set()
        await watcher
    return list(answers), waiting_seen


def test_ten_times_the_sustainable_rate_for_a_minute(burst_app: ServeApp) -> None:
    sustainable = asyncio.run(sustainable_rate(burst_app))
    rate = min(10 * sustainable, 40.0)
    answers, waiting_seen = asyncio.run(overload(burst_app, rate, 60.0))
    n = len(answers)
    by_status = {s: sum(a.status == s for a in answers) for s in {a.status for a in answers}}
    print(f"sustainable {sustainable:.2f} req/s; sent {n} at {rate:.1f} req/s; {by_status}")
    # Every request answered: 200 or 429 (with Retry-After), nothing else, nothing broken.
    assert set(by_status) <= {200, 429}, by_status
    assert all(a.error is None for a in answers), [a for a in answers if a.error][:3]
    assert all(a.retry_after is not None and a.retry_after.isdigit()
               for a in answers if a.status == 429)
    assert by_status.get(429, 0) > n // 4, f"ten times the rate was not an overload: {by_status}"
    # Refusals come from the admission check: faster than any accepted request's answer.
    refused = sorted(a.seconds for a in answers if a.status == 429)
    served = sorted(a.seconds for a in answers if a.status == 200)
    assert np.median(refused) < np.median(served), (refused[-5:], served[:5])
    # The queue stays bounded.
    assert waiting_seen and max(waiting_seen) <= MAX_WAITING, max(waiting_seen)
    # Lowest tier first.
    share = {t: sum(a.status == 429 for a in answers if a.tier == t)
             / max(1, sum(a.tier == t for a in answers)) for t, _ in TIERS}
    print(f"429 share by tier: {share}")
    assert share["batch"] > share["standard"] >= share["interactive"], share
    ttft = {t: [a.ttft for a in answers if a.tier == t and a.ttft is not None] for t, _ in TIERS}
    p99 = {t: float(np.percentile(v, 99)) for t, v in ttft.items() if v}
    print(f"p99 TTFT by tier: {p99}")
    # The interactive tier's TTFT is bounded: with every queue bounded it reaches a plateau in
    # the first seconds and does not keep growing (an unbounded queue would grow it linearly).
    def p90(lo: float, hi: float) -> float:
        v = [a.ttft for a in answers if a.tier == "interactive" and a.ttft is not None
             and lo <= a.at < hi]
        assert len(v) >= 10, (lo, hi, len(v))
        return float(np.percentile(v, 90))

    middle, last = p90(20.0, 40.0), p90(40.0, 60.0)
    print(f"interactive p90 TTFT, 20-40 s: {middle:.2f} s, 40-60 s: {last:.2f} s")
    # Three times the window before, or (on a machine whose speed moves during the minute) the
    # time to serve every request the ingress lets in twice over: an unbounded queue would be
    # past both (here 25 requests a second more than served pile up: minutes by the end).
    drain = 2.0 * ARGS["max_inflight_requests"] / sustainable
    assert last <= max(3.0 * middle, drain), (middle, last, drain)
    # Back to baseline.
    stats = burst_app.wait_idle()
    assert {k: s["free_blocks"] for k, s in stats.items()} == burst_app.baseline
    r = httpx.post(burst_app.url("/v1/completions"), timeout=60, headers=headers(KEYS["batch"]),
                   json={"model": MODEL, "prompt": "after the storm", "max_tokens": 4})
    assert r.status_code == 200, r.text
