"""The replica's log lines about a request carry the ingress's request id
(``GenerateRequest.request_id``, from ``X-Request-Id``), outside Serve."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.replica.llm_server import collect as run
from tests.replica.llm_server import llm_server
from tierserve.records import (
    BadRequest,
    ErrorRecord,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
)
from tierserve.replica.deployment import LLMServer


@pytest.fixture
def server() -> Iterator[LLMServer]:
    with llm_server() as s:
        yield s


def collect(server: LLMServer, request_id: str) -> list[RequestOutput | ErrorRecord]:
    return run(server, GenerateRequest((1, 2, 3), SamplingParams(max_tokens=2, ignore_eos=True),
                                       request_id=request_id))


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tierserve.replica"]


def test_a_served_request_is_logged_under_its_id(server: LLMServer,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="tierserve.replica"):
        items = collect(server, "trace-1")
    assert isinstance(items[-1], RequestOutput) and items[-1].finished
    mine = [line for line in lines(caplog) if "trace-1" in line]
    assert any("prompt tokens" in line for line in mine)
    assert any("finished" in line for line in mine)


def test_a_refusal_is_logged_under_its_id(server: LLMServer,
                                          caplog: pytest.LogCaptureFixture) -> None:
    server.inject_fault("injected: the GPU fell off the bus")
    with caplog.at_level(logging.INFO, logger="tierserve.replica"):
        (first,) = collect(server, "trace-2")
    assert isinstance(first, ErrorRecord)
    assert any("trace-2" in line and "GPU fell off the bus" in line for line in lines(caplog))


def test_a_refusals_message_cannot_forge_a_log_line(server: LLMServer,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A refusal's message may quote the client (a grammar compiler's complaint about its
    regex): it is logged as its repr, so its newlines cannot start a line of their own."""
    async def refused(request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        raise BadRequest("bad regex 'a\nrequest x: forged line'", "invalid_structured_output")
        yield  # an async generator, as the engine's stream is

    monkeypatch.setattr(server.engine, "generate", refused)
    with caplog.at_level(logging.INFO, logger="tierserve.replica"):
        (first,) = collect(server, "trace-3")
    assert isinstance(first, ErrorRecord) and first.code == "invalid_structured_output"
    (line,) = [line for line in lines(caplog) if "trace-3" in line]
    assert "\n" not in line and "invalid_structured_output" in line and "forged line" in line
