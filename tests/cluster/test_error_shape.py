"""One error shape for every error the API returns, and one decision of whether a request failed
before its first token. No Ray: the builder, the ingress's exception handlers and the replica's
``generate`` on a stand-in engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from types import MethodType, SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tierserve.cluster import ingress
from tierserve.cluster.ingress import error_event, error_response
from tierserve.cluster.protocol import ErrorResponse, error_body
from tierserve.records import (
    ErrorRecord,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    ServingError,
    failed_before_first_token,
)
from tierserve.replica.deployment import LLMServer
from tierserve.replica.load_report import LoadWindow

# ------------------------------------------------------------------ the builder


@pytest.mark.parametrize(("status", "type_"), [
    (400, "invalid_request_error"),
    (401, "authentication_error"),
    (404, "not_found_error"),
    (405, "invalid_request_error"),
    (413, "invalid_request_error"),
    (429, "rate_limit_error"),
    (503, "service_unavailable"),
    (500, "server_error"),  # any status without a name of its own
    (502, "server_error"),
])
def test_each_status_has_its_openai_type(status: int, type_: str) -> None:
    body = error_body(status, "what went wrong", "some_code", "some.param")
    assert body == {"error": {"message": "what went wrong", "type": type_, "code": "some_code",
                              "param": "some.param"}}
    assert list(body["error"]) == ["message", "type", "code", "param"]  # the order clients saw
    assert ErrorResponse.model_validate(body).error.type == type_


def test_code_and_param_are_null_when_not_given() -> None:
    assert error_body(503, "no replica") == {"error": {
        "message": "no replica", "type": "service_unavailable", "code": None, "param": None}}


def test_an_http_error_is_the_builder_s_body_with_retry_after_when_given() -> None:
    r = error_response(429, "the server is busy", "queue_full", retry_after=3)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.body == (b'{"error":{"message":"the server is busy","type":"rate_limit_error",'
                      b'"code":"queue_full","param":null}}')
    assert "retry-after" not in error_response(400, "bad", "invalid_request", "n").headers


def test_an_error_event_is_the_same_body_as_one_sse_event() -> None:
    event = error_event(ServingError("engine died", "replica_failed", status=503))
    assert event == ('data: {"error": {"message": "engine died", "type": "service_unavailable", '
                     '"code": "replica_failed", "param": null}}\n\n')
    # A line separator in the message stays escaped: the event is one line.
    odd = error_event(ServingError("a\u2028b\x85c", "invalid_request", "prompt", status=400))
    assert odd.count("\n") == 2 and odd.endswith("\n\n")
    assert json.loads(odd[len("data: "):]) == error_body(400, "a\u2028b\x85c", "invalid_request",
                                                         "prompt")


def test_starlette_s_own_errors_take_the_same_shape() -> None:
    client = TestClient(ingress.app)
    missing = client.get("/no/such/route")
    assert missing.status_code == 404
    assert without_request_id(missing) == error_body(404, "Not Found", "http_error")
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert without_request_id(wrong) == error_body(405, "Method Not Allowed", "http_error")


def without_request_id(response: Any) -> Any:
    """An HTTP error's body less its ``error.request_id``, which must be the response's
    ``X-Request-Id`` (every HTTP error carries it)."""
    body = response.json()
    assert body["error"].pop("request_id") == response.headers["x-request-id"]
    return body


@pytest.mark.parametrize(("error", "retry"), [
    (ServingError("the queue is full", "queue_full", status=429), "7"),
    (ServingError("shed by flow control", "shed", status=503), "7"),  # a shed answered 503 says when too
    (ServingError("unknown model", "model_not_found", "model", status=400), None),
    (ServingError("no replica", "replica_unavailable", status=503), None),
])
def test_an_api_error_is_answered_with_its_body(error: ServingError, retry: str | None) -> None:
    request: Any = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(retry_after=7)))
    r = asyncio.run(ingress._api_error(request, error))
    assert r.status_code == error.status
    assert json.loads(r.body) == error_body(error.status, error.message, error.code, error.param)
    assert r.headers.get("retry-after") == retry


def test_a_429_through_an_app_without_the_configs_retry_after_still_says_when() -> None:
    """The app a request came through may not be the object the ingress set up at start (a copy
    of the module's): its refusal keeps its 429 and the config's default Retry-After, never a 500."""
    request: Any = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace()))
    r = asyncio.run(ingress._api_error(request, ServingError("full", "queue_full", status=429)))
    assert r.status_code == 429 and r.headers.get("retry-after") == "1"


# ------------------------------------------------------------------ before/after the first token


def delta(tokens: int, finished: bool = False, reason: str | None = None,
          failure: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", "x" * tokens, [1] * tokens, finished=finished, finish_reason=reason,
                         prompt_tokens=3, completion_tokens=tokens, failure=failure, index=index)


@pytest.mark.parametrize(("first", "before"), [
    (delta(0, True, "error", "engine died"), True),
    (delta(0, True, "error"), True),
    (delta(2, True, "error", "engine died"), False),  # it had tokens: an error in the stream
    (delta(1), False),
    (delta(0), False),  # nothing made yet, nothing failed
    (delta(4, True, "length"), False),
    (delta(0, True, "abort"), False),  # the client left: not a failure
])
def test_failed_before_first_token(first: RequestOutput, before: bool) -> None:
    assert failed_before_first_token(first) is before


class FakeEngine:
    """``Engine.generate``'s stream, scripted."""

    def __init__(self, steps: Sequence[RequestOutput]) -> None:
        self.steps = list(steps)
        self.closed = False
        self.request: GenerateRequest | None = None

    def num_waiting(self) -> int:
        return 0

    def shutdown(self) -> None:  # LLMServer.__del__ stops its engine
        pass

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.request = request

        async def stream() -> AsyncIterator[RequestOutput]:
            try:
                for step in self.steps:
                    yield step
            finally:
                self.closed = True

        return stream()


def replica_stream(steps: Sequence[RequestOutput]) -> list[RequestOutput | ErrorRecord]:
    server = object.__new__(LLMServer)
    server.config = SimpleNamespace(max_waiting=8)  # type: ignore[assignment]
    engine = FakeEngine(steps)
    server.engine = engine  # type: ignore[assignment]
    server.replica_id = "replica-7"
    server.load = LoadWindow(block_size=16)

    async def go() -> list[RequestOutput | ErrorRecord]:
        request = GenerateRequest((1, 2, 3), SamplingParams(max_tokens=4), n=2)
        return [item async for item in server.generate(request)]

    items = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert engine.closed
    return items


def test_the_replica_refuses_a_request_that_failed_before_its_first_token() -> None:
    (only,) = replica_stream([delta(0, True, "error", "engine died"), delta(1)])
    assert only == ErrorRecord(503, "replica_unavailable", "engine died", replica="replica-7")


def test_the_replica_streams_a_failure_after_the_first_token_as_it_is() -> None:
    steps = [delta(1), delta(1, True, "error", "engine died")]
    assert replica_stream(steps) == steps
    # The first delta decides: a sample failing with no token of its own after another
    # sample's first delta is part of the answer too.
    steps = [delta(1), delta(0, True, "error", "engine died", index=1)]
    assert replica_stream(steps) == steps


def test_the_replica_hands_its_engine_the_time_left_to_the_first_token_target() -> None:
    """What the request waited before the replica (at the gate, or at a replica that failed
    it) comes off its tier's first-token target; without a target there is nothing to hand."""
    for target, waited, left in ((3.0, 1.25, 1.75), (3.0, 4.0, -1.0), (None, 1.0, None)):
        server = object.__new__(LLMServer)
        server.config = SimpleNamespace(max_waiting=8)  # type: ignore[assignment]
        engine = FakeEngine([delta(1, True, "length")])
        server.engine = engine  # type: ignore[assignment]
        server.replica_id = "replica-7"
        server.load = LoadWindow(block_size=16)

        async def go(server: LLMServer, target: float | None, waited: float) -> None:
            request = GenerateRequest((1, 2, 3), SamplingParams(max_tokens=4),
                                      ttft_target_s=target, tpot_target_s=0.1, waited_s=waited)
            async for _ in server.generate(request):
                pass

        asyncio.run(asyncio.wait_for(go(server, target, waited), timeout=30))
        assert engine.request is not None  # the record itself, as the ingress sent it
        assert engine.request.ttft_left_s == left and engine.request.tpot_target_s == 0.1


@pytest.mark.parametrize(("ttft", "tpot", "waited", "met"), [
    (0.5, 0.05, 1.0, True), (0.5, 0.05, 2.6, False), (0.5, 0.2, 0.0, False), (None, None, 0, None)])
def test_the_replicas_report_times_a_request_by_the_engines_one_clock(
        ttft: float | None, tpot: float | None, waited: float, met: bool | None) -> None:
    """The autoscaling report's met/missed comes from the times the engine put on the last
    delta (``ttft_s`` from its arrival at the engine, plus what it waited before), not from a
    clock of the deployment's own."""
    server = object.__new__(LLMServer)
    server.config = SimpleNamespace(max_waiting=8)  # type: ignore[assignment]
    last = delta(2, True, "length")
    last.ttft_s, last.tpot_s = ttft, tpot
    server.engine = FakeEngine([delta(1), last])  # type: ignore[assignment]
    server.replica_id = "replica-7"
    server.load = LoadWindow(block_size=16)

    async def go() -> None:
        request = GenerateRequest((1, 2, 3), SamplingParams(max_tokens=4), tier="interactive",
                                  ttft_target_s=3.0, tpot_target_s=0.1, waited_s=waited)
        async for _ in server.generate(request):
            pass

    asyncio.run(asyncio.wait_for(go(), timeout=30))
    report = server.load.report(0.0, 0.0, 0)
    if met is None:  # no first token: nothing to judge
        assert not report.met and not report.missed
    else:
        assert report.met.get("interactive", 0) == (1 if met else 0)
        assert report.missed.get("interactive", 0) == (0 if met else 1)


def test_chat_with_a_base_model_says_to_use_completions() -> None:
    """A model without a chat template (a base model: gemma-3-270m) answers a chat request with
    a 400 that names the model and the endpoint to use, before anything is rendered."""
    from starlette.requests import Request

    from tierserve.cluster.app import load_config
    from tierserve.cluster.tiers import TierResolver
    from tierserve.records import BadRequest

    cls: Any = ingress.Ingress.func_or_class
    cfg = load_config({"engine": {"model": "gemma-3-270m"}})
    # The ingress's own methods over only what they read (no deployment is built).
    served = SimpleNamespace(name="gemma-3-270m", tokenizer=SimpleNamespace(chat_template=None))
    inst = SimpleNamespace(cfg=cfg, tiers=TierResolver(cfg), served={served.name: served})
    inst._caller = MethodType(cls._caller, inst)
    inst._model = MethodType(cls._model, inst)
    inst._resolve = MethodType(cls._resolve, inst)
    inst._body = MethodType(cls._body, inst)
    inst._chat = MethodType(cls._chat, inst)
    body = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}]})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body.encode(), "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-length", str(len(body)).encode())]}
    with pytest.raises(BadRequest) as caught:
        asyncio.run(cls.chat(inst, Request(scope, receive)))
    assert caught.value.code == "no_chat_template" and caught.value.param == "messages"
    assert caught.value.message == (
        "model 'gemma-3-270m' has no chat template (a base model, which continues text): send "
        "a prompt to /v1/completions instead")
