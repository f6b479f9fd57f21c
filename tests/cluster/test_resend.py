"""The ingress sends a request again when its replica fails before any of the answer has gone to
the client, avoiding a replica that named itself failed; and never once the client has text.
No Ray: the ingress's own logic against a stand-in replica handle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import JSONResponse, StreamingResponse

from tierserve.cluster import ingress as ingress_mod
from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.ingress import _Call
from tierserve.cluster.protocol import error_body
from tierserve.cluster.tiers import Caller
from tierserve.records import (
    ErrorRecord,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    ServingError,
)


class ActorDied(Exception):
    """What a Ray handle raises when the replica's actor is gone."""


Step = RequestOutput | ErrorRecord | Exception


class FakeStream:
    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = list(steps)
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput | ErrorRecord:
        if not self.steps:
            raise StopAsyncIteration
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """``generate.remote`` hands out the scripted streams in order and keeps the requests."""

    def __init__(self, *scripts: Sequence[Step]) -> None:
        self.scripts = list(scripts)
        self.sent: list[GenerateRequest] = []
        self.streams: list[FakeStream] = []
        self.generate = self

    def remote(self, request: GenerateRequest) -> FakeStream:
        self.sent.append(request)
        stream = FakeStream(self.scripts.pop(0))
        self.streams.append(stream)
        return stream


def out(text: str, tokens: int, finished: bool = False, reason: str | None = None,
        failure: str | None = None) -> RequestOutput:
    return RequestOutput("r", text, [1] * (1 if text or tokens else 0), finished=finished,
                         finish_reason=reason, prompt_tokens=3, completion_tokens=tokens,
                         failure=failure)


def ingress(handle: FakeHandle, retries: int = 2) -> Any:
    """The ingress class's logic on a stand-in handle (its constructor loads a tokenizer)."""
    cls = next(c for c in ingress_mod.Ingress.func_or_class.__mro__ if "_generate" in c.__dict__)
    self = object.__new__(cls)
    self.cfg = ClusterConfig(replica_retries=retries)
    self.metrics = SimpleNamespace(slo=lambda *args: None)
    return self


def served(handle: FakeHandle) -> Any:
    """The model's record as the sends read it (no gate: flow control is the gate's tests',
    tests/cluster/test_flow_queues.py)."""
    return SimpleNamespace(name=ClusterConfig().model_name, llm=handle, prefix_root=None,
                           token_text=None, gate=None)


CALLER = Caller(tier=ClusterConfig().tiers[0], priority=0)


def generate(handle: FakeHandle, stream: bool, retries: int = 2) -> Any:
    async def go() -> Any:
        ing = ingress(handle, retries)
        call = _Call(chat=False, n=1, ids=[1, 2, 3], served=served(handle))
        route = ingress_mod._Route(SamplingParams(max_tokens=4), CALLER, retries)
        response = await ing._generate(stream, call, route)
        if isinstance(response, StreamingResponse):
            return [chunk async for chunk in response.body_iterator]
        assert isinstance(response, JSONResponse)
        return json.loads(response.body)

    return asyncio.run(asyncio.wait_for(go(), timeout=30))


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    async def instant(_: float) -> None:
        return None

    monkeypatch.setattr(ingress_mod.asyncio, "sleep", instant)


def events(chunks: list[str]) -> list[Any]:
    body = "".join(chunks)
    return [e[len("data: "):] if e.endswith("[DONE]") else json.loads(e[len("data: "):])
            for e in body.split("\n\n") if e]


GOOD = [out("Hel", 1), out("lo", 2, True, "length")]


def test_a_replica_whose_engine_failed_is_named_and_the_retry_avoids_it() -> None:
    handle = FakeHandle([ErrorRecord(503, "replica_unavailable", "engine died", replica="A")],
                        GOOD)
    body = generate(handle, stream=False)
    assert body["choices"][0]["text"] == "Hello"
    assert [r.avoid_replicas for r in handle.sent] == [(), ("A",)]


def test_a_stream_whose_replica_dies_before_any_text_went_out_is_sent_again() -> None:
    # The dead replica had made a token whose text was held back (an incomplete character):
    # nothing reached the client, so the answer starts over on another replica.
    handle = FakeHandle([out("", 1), ActorDied("gone")], GOOD)
    evs = events(generate(handle, stream=True))
    assert [e["choices"][0]["text"] for e in evs[:-1]] == ["Hel", "lo"]
    assert evs[-1] == "[DONE]" and len(handle.sent) == 2
    assert all(s.cancelled for s in handle.streams)  # both streams closed: nothing left running


def test_a_stream_that_already_sent_text_ends_with_an_error_event_not_a_resend() -> None:
    handle = FakeHandle([out("Hel", 1), ActorDied("gone")], GOOD)
    evs = events(generate(handle, stream=True))
    assert evs[0]["choices"][0]["text"] == "Hel"
    assert evs[1]["error"]["code"] == "replica_unavailable"
    assert evs[1]["error"]["type"] == "service_unavailable"
    assert evs[2] == "[DONE]" and len(handle.sent) == 1


def test_an_engine_failing_mid_answer_of_an_unstreamed_request_is_sent_again() -> None:
    handle = FakeHandle([out("Hel", 1), out("", 1, True, "error", failure="engine died")], GOOD)
    body = generate(handle, stream=False)
    assert body["choices"][0]["text"] == "Hello"  # the first replica's part is not kept
    assert body["usage"]["completion_tokens"] == 2


def test_when_every_send_fails_the_client_gets_503_saying_so() -> None:
    dead = [ErrorRecord(503, "replica_unavailable", "engine died", replica="A")]
    handle = FakeHandle(dead, dead, dead)
    with pytest.raises(ServingError) as e:
        generate(handle, stream=False, retries=2)
    assert (e.value.status, e.value.code) == (503, "replica_unavailable")
    assert len(handle.sent) == 3  # the first send and replica_retries more


def test_a_refusal_is_not_sent_again() -> None:
    handle = FakeHandle([ErrorRecord(429, "queue_full", "the queue is full")], GOOD)
    with pytest.raises(ServingError) as e:
        generate(handle, stream=False)
    assert (e.value.status, e.value.code) == (429, "queue_full") and len(handle.sent) == 1


def test_a_resend_refused_mid_stream_ends_the_stream_with_its_error() -> None:
    handle = FakeHandle([out("", 1), ActorDied("gone")],
                        [ErrorRecord(429, "queue_full", "the queue is full")])
    evs = events(generate(handle, stream=True))
    assert evs[0]["error"]["code"] == "queue_full"
    assert evs[0]["error"]["type"] == "rate_limit_error"
    assert evs[1] == "[DONE]"



def test_a_first_delta_failed_with_no_token_is_sent_again() -> None:
    # The replica refuses such a request itself; the ingress decides the same of a delta that
    # reaches it (``failed_before_first_token``).
    handle = FakeHandle([out("", 0, True, "error", failure="engine died")], GOOD)
    body = generate(handle, stream=False)
    assert body["choices"][0]["text"] == "Hello" and len(handle.sent) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_failure_before_the_first_token_with_no_send_left_is_an_http_503(stream: bool) -> None:
    handle = FakeHandle([out("", 0, True, "error", failure="engine died")])
    with pytest.raises(ServingError) as e:
        generate(handle, stream=stream, retries=0)
    assert (e.value.status, e.value.code, e.value.message) == (
        503, "replica_unavailable", "engine died")


def test_a_failure_after_the_first_token_with_no_send_left_ends_the_stream() -> None:
    handle = FakeHandle([out("Hel", 1), out("", 1, True, "error", failure="engine died")])
    chunks = generate(handle, stream=True, retries=0)
    # The error event, byte for byte the body an HTTP error would have.
    assert chunks[1] == ('data: {"error": {"message": "engine died", "type": '
                         '"service_unavailable", "code": "replica_failed", "param": null}}\n\n')
    evs = events(chunks)
    assert evs[0]["choices"][0]["text"] == "Hel" and evs[2] == "[DONE]"
    assert evs[1] == error_body(503, "engine died", "replica_failed")


def test_a_failure_after_the_first_token_of_an_unstreamed_request_is_an_http_503() -> None:
    handle = FakeHandle([out("Hel", 1, True, "error", failure="engine died")])
    with pytest.raises(ServingError) as e:
        generate(handle, stream=False, retries=0)
    assert (e.value.status, e.value.code, e.value.message) == (503, "replica_failed",
                                                               "engine died")
