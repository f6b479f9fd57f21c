"""A client that goes away: its request is aborted on the replica and its blocks return.

On the single-replica ``solo`` app the replica's step counter proves the abort: the request asked
for 1500 tokens (one step each), so had it run to the end instead the counter would have moved by
at least 1500 before the replica fell idle.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.cluster.helpers import KEYS, MODEL, ServeApp, headers, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LONG = 1500  # tokens: 1500 + the prompt fit both apps' pools (96 and 260 blocks of 16)


def long_body(chat: bool, stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": LONG, "ignore_eos": True,
                            "stream": stream}
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": "go"}]}
    return "/v1/completions", body | {"prompt": "go on and on"}


def read_then_hang_up(app: ServeApp, chat: bool, key: str | None = None) -> list[Any]:
    """Stream a long request, read two events with text, then close the connection."""
    path, body = long_body(chat, stream=True)
    events: list[Any] = []
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", app.url(path), json=body, headers=headers(key)
    ) as response:
        assert response.status_code == 200
        for event in sse_events(response.iter_lines()):
            assert event != "[DONE]"
            choice = event["choices"][0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                events.append(event)
            if len(events) == 2:
                break
    return events


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_hanging_up_mid_stream_returns_the_blocks_of_every_replica(main_app: ServeApp,
                                                                   chat: bool) -> None:
    events = read_then_hang_up(main_app, chat)
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    stats = main_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == main_app.baseline


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_hanging_up_mid_stream_aborts_the_request(solo_app: ServeApp, chat: bool) -> None:
    before = solo_app.engine_stats().steps
    read_then_hang_up(solo_app, chat, KEYS["standard"])
    stats = solo_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == solo_app.baseline
    steps = solo_app.engine_stats().steps - before
    assert 2 <= steps < LONG, steps


def test_hanging_up_on_a_non_streaming_request_aborts_it(solo_app: ServeApp) -> None:
    """The client closes its socket while the replica is still generating the whole answer."""
    before = solo_app.engine_stats().steps
    path, body = long_body(chat=False, stream=False)
    url = urlsplit(solo_app.url(path))
    payload = json.dumps(body).encode()
    head = (f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {KEYS['batch']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    assert url.hostname is not None and url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head + payload)
        solo_app.wait_stats("the request running", lambda s: sum(
            r["running"] for r in s.values()) == 1)
    stats = solo_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == solo_app.baseline
    steps = solo_app.engine_stats().steps - before
    assert 1 <= steps < LONG, steps
