"""The pieces every HTTP tool shares (``tierserve.cluster.measure``: ``tierserve-load`` and the
benchmarks'): the served model from ``GET /v1/models`` and its errors, what counts as answered
while a server starts, and the verdict that fails a run which measured nothing."""

from __future__ import annotations

import asyncio
import io
import socket

import httpx
import pytest

from tests.fake_api import MODEL, Behaviour, FakeApi
from tierserve.cluster.measure import (
    NotServing,
    RequestsFailed,
    answered,
    error_code,
    model_from_listing,
    served_model,
    served_model_async,
    verdict,
)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------- served model


def test_the_served_model_is_the_first_the_server_lists() -> None:
    with FakeApi(Behaviour(models=["first", "second"])) as api:
        assert served_model(api.url) == "first"
        assert served_model(api.url + "/") == "first"


def test_a_listing_that_is_an_http_error_names_the_url_and_the_answer() -> None:
    with FakeApi(Behaviour(models_status=404)) as api, pytest.raises(NotServing) as e:
        served_model(api.url)
    msg = str(e.value)
    assert f"{api.url}/v1/models answered 404" in msg and "model_not_found" in msg


def test_an_empty_listing_is_no_model_and_not_a_server_still_starting() -> None:
    with FakeApi(Behaviour(models=[])) as api, pytest.raises(RequestsFailed) as e:
        served_model(api.url)
    assert not isinstance(e.value, NotServing)
    assert f"{api.url}/v1/models serves no model" in str(e.value)
    assert '"data": []' in str(e.value)


@pytest.mark.parametrize("body", [b'{"models": ["a"]}', b"<html>hello</html>", b'{"data": 3}'])
def test_an_answer_that_is_not_a_model_list_is_refused(body: bytes) -> None:
    url = "http://127.0.0.1:9/v1/models"
    with pytest.raises(RequestsFailed, match=r"answered 200 .*not a model list") as e:
        model_from_listing(url, httpx.Response(200, content=body))
    assert not isinstance(e.value, NotServing) and url in str(e.value)


def test_an_unreachable_server_is_named() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(NotServing, match=rf"could not reach {url}/v1/models \(ConnectError"):
        served_model(url, timeout_s=5)


def test_the_served_model_on_an_async_client() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"data": [{"id": "m1"}]})

    async def go(transport: httpx.MockTransport) -> str:
        async with httpx.AsyncClient(transport=transport) as client:
            return await served_model_async(client, "http://server")

    assert asyncio.run(go(httpx.MockTransport(handler))) == "m1"
    refusing = httpx.MockTransport(lambda r: httpx.Response(503, text="starting"))
    with pytest.raises(NotServing, match=r"http://server/v1/models answered 503 starting"):
        asyncio.run(go(refusing))

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(NotServing, match="could not reach http://server/v1/models"):
        asyncio.run(go(httpx.MockTransport(down)))


# ---------------------------------------------------------------------------------- answered


def test_error_codes_are_read_from_openai_error_bodies_only() -> None:
    assert error_code(b'{"error": {"code": "queue_full", "message": "m"}}') == "queue_full"
    for body in (b"", b"nope", b'{"error": "x"}', b'{"error": {"message": "m"}}', b"[1]"):
        assert error_code(body) is None, body


def test_answered_waits_on_a_server_starting_and_fails_on_a_refusal_for_good() -> None:
    req = httpx.Request("POST", "http://h/v1/completions")
    assert answered(httpx.Response(200, request=req))
    for status in (429, 500, 503):
        assert not answered(httpx.Response(status, request=req,
                                           json={"error": {"code": "queue_full"}}))
    assert not answered(httpx.Response(404, request=req, text="Path not found"))  # a proxy
    with pytest.raises(RequestsFailed, match=r"POST http://h/v1/completions was refused: "
                                             r"404 model_not_found"):
        answered(httpx.Response(404, request=req, json={"error": {"code": "model_not_found"}}))
    with pytest.raises(RequestsFailed, match="the request was refused: 401 invalid_api_key"):
        answered(httpx.Response(401, json={"error": {"code": "invalid_api_key"}}))


# ---------------------------------------------------------------------------------- verdict


def test_a_run_with_answers_and_a_loaded_servers_refusals_passes() -> None:
    v = verdict(sent=10, succeeded=7, errors={"queue_full": 2, "shed": 1})
    assert v.passed and v.reasons == () and v.unexpected == {}
    out = io.StringIO()
    assert v.conclude("tool", out) == 0 and out.getvalue() == ""
    assert v.record()["passed"] is True


def test_a_run_where_nothing_succeeded_fails() -> None:
    v = verdict(sent=5, succeeded=0, errors={"queue_full": 5})
    assert v.reasons == ("no request succeeded (5 sent; clear errors by code: "
                         "{'queue_full': 5})",)
    assert verdict(sent=0, succeeded=0, errors={}).reasons == ("no request succeeded (0 sent)",)
    out = io.StringIO()
    assert v.conclude("tierserve-x", out) == 1
    assert out.getvalue() == ("tierserve-x: FAILED: no request succeeded (5 sent; clear errors "
                              "by code: {'queue_full': 5})\n")


def test_clear_errors_the_mix_does_not_ask_for_fail_it_by_code() -> None:
    v = verdict(sent=603, succeeded=0, errors={"model_not_found": 603})
    assert not v.passed and v.unexpected == {"model_not_found": 603}
    assert v.reasons[1] == ("603 clear errors the mix does not ask for, by code: "
                            "{'model_not_found': 603} (all clear errors: "
                            "{'model_not_found': 603})")
    # one is enough, among many answers
    one = verdict(sent=100, succeeded=99, errors={"invalid_api_key": 1})
    assert one.reasons == ("1 clear errors the mix does not ask for, by code: "
                           "{'invalid_api_key': 1} (all clear errors: {'invalid_api_key': 1})",)
    assert one.record()["unexpected"] == {"invalid_api_key": 1}


def test_clear_errors_the_mix_asks_for_pass_up_to_their_number() -> None:
    asked = {"invalid_request": 3}
    assert verdict(sent=10, succeeded=7, errors={"invalid_request": 3}, expected=asked).passed
    over = verdict(sent=10, succeeded=6, errors={"invalid_request": 4}, expected=asked)
    assert over.unexpected == {"invalid_request": 1}
    assert "the mix asks for {'invalid_request': 3}" in over.reasons[0]
    # what is tolerated is the caller's: no tolerance, a full queue fails the run
    assert not verdict(sent=3, succeeded=2, errors={"queue_full": 1}, tolerated=()).passed


def test_the_served_model_and_verdict_on_a_real_socket() -> None:
    """The fake server of these tests answers as the tools expect (a check of the fixture)."""
    with FakeApi() as api:
        r = httpx.post(f"{api.url}/v1/completions", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and error_code(r.content) == "model_not_found"
        r = httpx.post(f"{api.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert [b["model"] for b in api.completions] == ["other", MODEL]
