"""Overload and failure on the single-replica ``solo`` app: 429 by tier, then 503.

The replica runs at most 2 requests and queues at most 8. With two long requests holding the
running slots, the waiting queue fills up by tier: ``batch`` (queue_share 0.5) is refused from
4 waiting on, ``standard`` (0.8) from 6, ``interactive`` (1.0) only when the queue is full at 8;
every refusal is a 429 with ``Retry-After``. A client that gives up while waiting leaves the
queue. When the holders hang up, everything accepted completes.

Then the replica's actor is killed in the middle of two requests that have both produced tokens:
the streaming one, whose client has text, ends with an error event; the non-streaming one, of
which nothing has gone out yet, is sent again and completes on the replica Serve starts instead
(a request whose every send fails gets a 503: ``tests/cluster/test_resend.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import ray

from tests.cluster.helpers import KEYS, MODEL, ServeApp, assert_error, headers, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]

C = "/v1/completions"
SHORT = {"model": MODEL, "prompt": "queued", "max_tokens": 4, "ignore_eos": True}
HOLD = {"model": MODEL, "prompt": "hold", "max_tokens": 2000, "ignore_eos": True,
        "stream": True}


@contextlib.asynccontextmanager
async def holding(client: httpx.AsyncClient, key: str) -> AsyncIterator[Any]:
    """A long streaming request, open until the block exits (then the client hangs up)."""
    async with client.stream("POST", C, json=HOLD, headers=headers(key)) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        yield lines


async def stats_when(app: ServeApp, what: str, **want: int) -> dict[str, Any]:
    """The replica's report once its ``running``/``waiting`` are ``want`` (polled in a thread)."""
    def ok(stats: dict[str, dict[str, Any]]) -> bool:
        (s,) = stats.values()
        return all(s[k] == v for k, v in want.items())

    stats = await asyncio.to_thread(app.wait_stats, what, ok)
    (s,) = stats.values()
    return s


async def burst(client: httpx.AsyncClient, key: str, n: int,
                refused: int) -> tuple[list[httpx.Response], list[asyncio.Task[httpx.Response]]]:
    """Send ``n`` short requests at once; wait for ``refused`` of them to be answered.

    Returns those answers and the tasks still waiting (queued on the replica).
    """
    tasks = [asyncio.create_task(client.post(C, json=SHORT, headers=headers(key)))
             for _ in range(n)]
    done: set[asyncio.Task[httpx.Response]] = set()
    pending = set(tasks)
    while len(done) < refused:
        finished, pending = await asyncio.wait(pending, timeout=120,
                                               return_when=asyncio.FIRST_COMPLETED)
        assert finished, f"only {len(done)} of {n} answered; expected {refused} refusals"
        done |= finished
    answers = [t.result() for t in done]
    return answers, [t for t in tasks if t in pending]


async def overload(app: ServeApp) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
        async with holding(client, KEYS["interactive"]), holding(client, KEYS["interactive"]):
            await stats_when(app, "2 running", running=2, waiting=0)

            out["batch"], batch_q = await burst(client, KEYS["batch"], 6, refused=2)
            await stats_when(app, "4 waiting", running=2, waiting=4)
            oa = app.async_client(KEYS["batch"])
            try:
                with pytest.raises(openai.RateLimitError) as e:
                    await oa.completions.create(model=MODEL, prompt="queued", max_tokens=4)
            finally:
                await oa.close()
            out["batch_openai"] = e.value

            out["standard"], std_q = await burst(client, KEYS["standard"], 3, refused=1)
            await stats_when(app, "6 waiting", running=2, waiting=6)
            out["batch_late"], late_q = await burst(client, KEYS["batch"], 1, refused=1)

            out["interactive"], int_q = await burst(client, KEYS["interactive"], 3, refused=1)
            await stats_when(app, "8 waiting", running=2, waiting=8)

            # A caller that gives up while queued leaves the queue; its place is free again.
            batch_q[0].cancel()
            await stats_when(app, "7 waiting", running=2, waiting=7)
            out["interactive_2"], int_q2 = await burst(client, KEYS["interactive"], 1,
                                                       refused=0)
            await stats_when(app, "8 waiting again", running=2, waiting=8)
            assert not late_q
        # The holders hung up: everything queued runs now.
        queued = batch_q[1:] + std_q + int_q + int_q2
        out["queued"] = await asyncio.wait_for(asyncio.gather(*queued), timeout=300)
        with contextlib.suppress(asyncio.CancelledError):
            await batch_q[0]
    return out


def test_batch_is_refused_first_then_standard_then_interactive(solo_app: ServeApp) -> None:
    out = asyncio.run(overload(solo_app))

    for r in out["batch"] + out["standard"] + out["batch_late"]:
        err = assert_error(r, 429, "shed")
        assert err["type"] == "rate_limit_error"
        assert r.headers["retry-after"] == "1"  # retry_after_s of the config
    assert "(4) is full" in out["batch"][0].json()["error"]["message"]
    assert "(6) is full" in out["standard"][0].json()["error"]["message"]
    (full,) = out["interactive"]
    assert_error(full, 429, "queue_full")
    assert full.headers["retry-after"] == "1"
    e: openai.RateLimitError = out["batch_openai"]
    assert e.status_code == 429 and e.code == "shed"
    assert e.response.headers["retry-after"] == "1"

    queued = out["queued"]
    assert len(queued) == 3 + 2 + 2 + 1
    for r in queued:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4

    stats = solo_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == solo_app.baseline


# ---------------------------------------------------------------------- 503 (kills the replica)


async def die_mid_request(app: ServeApp) -> tuple[httpx.Response, list[Any]]:
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
        whole = asyncio.create_task(
            client.post(C, json=HOLD | {"stream": False}, headers=headers(KEYS["standard"])))
        async with holding(client, KEYS["batch"]) as lines:
            s = await stats_when(app, "2 running", running=2)
            # Both requests have produced tokens (a request that has not is sent again, to the
            # replica Serve starts instead: that is the faults tests' subject, not this one's).
            steps = int(s["steps"])
            await asyncio.to_thread(app.wait_stats, "3 more steps",
                                    lambda st: all(int(x["steps"]) >= steps + 3
                                                   for x in st.values()))
            await asyncio.sleep(0.5)
            (actor,) = app.replicas().values()
            ray.kill(actor, no_restart=True)
            tail = [e async for e in _events(lines)]
        return await asyncio.wait_for(whole, timeout=120), tail


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[Any]:
    async for line in lines:
        for event in sse_events(iter([line])):
            yield event


def test_a_replica_dying_mid_request_ends_the_stream_and_resends_the_unstreamed_one(
        solo_app: ServeApp) -> None:
    response, tail = asyncio.run(die_mid_request(solo_app))

    # Nothing of the unstreamed answer had gone out: it was sent again and completed in full.
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == HOLD["max_tokens"]
    # The stream had begun (200 and events sent): it ends with an error event, then [DONE].
    assert tail[-1] == "[DONE]"
    assert tail[-2]["error"]["code"] == "replica_unavailable"
    assert tail[-2]["error"]["type"] == "service_unavailable"
    assert all("choices" in e for e in tail[:-2])
