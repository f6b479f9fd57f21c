"""Request ids (no Ray): ``X-Request-Id`` taken (or made) by the ingress's middleware, sent back
on every response (errors and unhandled faults included) and in error bodies, and carried to
the replica in ``GenerateRequest.request_id``."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tests.cluster.stub_ingress import StubIngress
from tierserve.cluster import ingress
from tierserve.cluster.ingress import RequestIds, request_id_of


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress()


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse(request_id_of(request) or "")


async def _boom(request: Request) -> PlainTextResponse:
    raise RuntimeError("secret detail")


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = Starlette(routes=[Route("/ok", _ok), Route("/boom", _boom)])
    app.add_middleware(RequestIds)
    return TestClient(app, raise_server_exceptions=False)


def test_a_sent_id_is_kept_and_sent_back(client: TestClient) -> None:
    r = client.get("/ok", headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.text == "trace-42"
    assert r.headers["x-request-id"] == "trace-42"


def test_an_id_is_made_when_none_is_sent(client: TestClient) -> None:
    a, b = client.get("/ok"), client.get("/ok")
    assert a.headers["x-request-id"] == a.text and a.text.startswith("req-")
    assert a.text != b.text


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "tab\there", "é", "ends-in\n",
                                 "ends-in\r\n"])
def test_a_malformed_id_is_a_400_under_a_new_id(client: TestClient, bad: str) -> None:
    r = client.get("/ok", headers={b"X-Request-Id": bad.encode("utf-8")})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_request_id" and error["param"] == "X-Request-Id"
    assert "1 to 128 visible ASCII" in error["message"]
    assert error["request_id"] == r.headers["x-request-id"] != bad


def test_an_unhandled_fault_is_a_500_with_the_id(client: TestClient) -> None:
    r = client.get("/boom", headers={"X-Request-Id": "trace-500"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "trace-500"
    error = r.json()["error"]
    assert error["request_id"] == "trace-500" and error["code"] == "internal_error"
    assert "secret detail" not in r.text and "RuntimeError" in error["message"]


def test_the_ingress_app_answers_an_unknown_path_with_the_id() -> None:
    r = TestClient(ingress.app).get("/no/such/path", headers={"X-Request-Id": "trace-404"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "trace-404"
    assert r.json()["error"]["request_id"] == "trace-404"


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_the_id_reaches_the_replica_and_names_the_answer(stub: StubIngress, route: str,
                                                         body: dict[str, Any]) -> None:
    answer = stub.post(route, {"model": stub.model, **body}, {"X-Request-Id": "trace-7"})
    assert answer.status == 200, answer.body
    assert stub.sent[-1].request_id == "trace-7"
    assert answer.body["id"].endswith("-trace-7")
    # The body's request_id names the answer even beside a header (which still goes to the
    # replica); without the header, the body's names it too.
    answer = stub.post(route, {"model": stub.model, "request_id": "body-1", **body},
                       {"X-Request-Id": "trace-8"})
    assert answer.body["id"].endswith("-body-1") and stub.sent[-1].request_id == "trace-8"
    answer = stub.post(route, {"model": stub.model, "request_id": "body-1", **body})
    assert answer.body["id"].endswith("-body-1")
    assert stub.sent[-1].request_id == "req-stub"  # the id the middleware made


def test_an_error_body_carries_the_id(stub: StubIngress) -> None:
    answer = stub.post("/v1/completions", {"model": "nope", "prompt": "x"},
                       {"X-Request-Id": "trace-9"})
    assert answer.status == 404
    assert answer.body["error"]["request_id"] == "trace-9"
    assert answer.headers["x-request-id"] == "trace-9"


def test_the_openapi_document_has_the_header(stub: StubIngress) -> None:
    doc = stub.inst.openapi_doc
    op = doc["paths"]["/v1/completions"]["post"]
    assert any(p["name"] == "X-Request-Id" for p in op["parameters"])
    assert "X-Request-Id" in op["responses"]["400"]["headers"]
    assert "request_id" in doc["components"]["schemas"]["ErrorDetail"]["properties"]


def test_a_stream_error_event_carries_the_id() -> None:
    from tierserve.records import Unavailable

    event = ingress.error_event(Unavailable("gone", "replica_failed"), "trace-s")
    assert '"request_id": "trace-s"' in event
    assert "request_id" not in ingress.error_event(Unavailable("gone", "replica_failed"))


def test_under_serve_the_proxy_s_header_is_the_only_one(client: TestClient,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's proxy sets ``X-Request-Id`` on the request and adds it to every response: the
    app then adds none of its own (no second header), and uses the id the proxy passed."""
    monkeypatch.setattr(ingress._proxy, "checked", True)
    r = client.get("/ok", headers={"X-Request-Id": "from-proxy"})
    assert r.text == "from-proxy" and "x-request-id" not in r.headers
    r = client.get("/boom", headers={"X-Request-Id": "from-proxy"})
    assert r.status_code == 500 and "x-request-id" not in r.headers
    assert r.json()["error"]["request_id"] == "from-proxy"
    r = TestClient(ingress.app).get("/nope", headers={"X-Request-Id": "from-proxy"})
    assert r.status_code == 404 and "x-request-id" not in r.headers
    assert r.json()["error"]["request_id"] == "from-proxy"
