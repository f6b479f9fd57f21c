"""A batched streamed completions request (several prompts, ``stream: true``): its prompts'
streams joined into one (``ingress._joined_stream``). When one prompt's stream ends in an error,
or the client hangs up, every other prompt's stream is closed cleanly (no ``RuntimeError``
from closing a generator its pump is still running) and each releases its place in flight. No
Ray: the real ingress class over a stand-in engine (``stub_ingress``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.cluster.stub_ingress import StubIngress
from tierserve.cluster import ingress


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress()


def chunk(index: int, text: str) -> str:
    return ingress.sse_event(json.dumps({"id": "cmpl-x", "object": "text_completion",
                                         "choices": [{"index": index, "text": text}]}))


ERROR = ingress.sse_event(json.dumps({"error": {"message": "boom", "code": "server_error"}}))


async def waits_forever(closed: list[str], name: str) -> AsyncIterator[str]:
    """A prompt's stream that sends one chunk, then waits for a token that never comes."""
    try:
        yield chunk(0, name)
        await asyncio.Event().wait()
        yield chunk(0, "never")
    finally:
        closed.append(name)


async def fails(closed: list[str]) -> AsyncIterator[str]:
    try:
        await asyncio.sleep(0)
        yield ERROR
    finally:
        closed.append("failing")


def in_flight(stub: StubIngress, streams: list[AsyncIterator[str]]) -> list[AsyncIterator[Any]]:
    """Each stream as ``_serve`` hands it on: counted in flight until it ends."""
    stub.inst.inflight += len(streams)
    return [stub.inst._release_after(s, "standard") for s in streams]


def test_an_error_in_one_prompt_closes_the_others(stub: StubIngress) -> None:
    async def go() -> list[str]:
        closed: list[str] = []
        streams = in_flight(stub, [waits_forever(closed, "a"), fails(closed),
                                   waits_forever(closed, "b")])
        events = [e async for e in ingress._joined_stream(streams, 1, False)]
        assert sorted(closed) == ["a", "b", "failing"]  # every stream ended with it
        return events

    before = stub.inst.inflight
    events = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert events[-2:] == [ERROR, "data: [DONE]\n\n"]
    assert stub.inst.inflight == before  # every prompt's place released


def test_a_hang_up_closes_every_prompts_stream(stub: StubIngress) -> None:
    async def go() -> list[str]:
        closed: list[str] = []
        streams = in_flight(stub, [waits_forever(closed, "a"), waits_forever(closed, "b")])
        joined = ingress._joined_stream(streams, 1, False)
        first = await joined.__anext__()
        assert json.loads(first[len("data: "):])["choices"][0]["text"] in ("a", "b")
        await joined.aclose()  # the client went away: Starlette closes the body
        return closed

    before = stub.inst.inflight
    closed = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert sorted(closed) == ["a", "b"]
    assert stub.inst.inflight == before


def test_a_batched_stream_through_the_route_releases_its_prompts(stub: StubIngress) -> None:
    answer = stub.send("/v1/completions", {"model": stub.model, "prompt": ["Hi", "Ho"],
                                           "max_tokens": 2, "stream": True})
    assert answer.status == 200
    assert sorted(c["index"] for e in answer.body for c in e["choices"]) == [0, 1]
    assert stub.inst.inflight == 0
