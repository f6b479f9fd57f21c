"""The replica's answer when its engine has failed, outside Serve: a refusal that names the
replica, so the ingress sends the request elsewhere and the router avoids this one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.replica.llm_server import collect as run
from tests.replica.llm_server import llm_server
from tierserve.records import ErrorRecord, GenerateRequest, RequestOutput, SamplingParams
from tierserve.replica.deployment import LLMServer


@pytest.fixture
def server() -> Iterator[LLMServer]:
    with llm_server() as s:
        yield s


def collect(server: LLMServer, max_tokens: int = 4) -> list[RequestOutput | ErrorRecord]:
    return run(server, GenerateRequest((1, 2, 3), SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True)))


def test_a_healthy_replica_streams_deltas(server: LLMServer) -> None:
    items = collect(server)
    assert all(isinstance(i, RequestOutput) for i in items)
    assert items[-1].finished and items[-1].finish_reason == "length"  # type: ignore[union-attr]


def test_an_engine_failing_before_the_first_token_is_a_refusal_naming_the_replica(
        server: LLMServer) -> None:
    server.inject_fault("injected: the GPU fell off the bus")
    (first,) = collect(server)
    assert first == ErrorRecord(503, "replica_unavailable", first.message, replica="replica-7")
    assert "GPU fell off the bus" in first.message
    # Once the engine is dead, a new request is refused the same way, before admission.
    (again,) = collect(server)
    assert isinstance(again, ErrorRecord)
    assert (again.status, again.code, again.replica) == (503, "replica_unavailable", "replica-7")
    # Nothing leaked: no request left, every block free (or cached).
    s = server.engine.stats()
    assert (s.running, s.waiting) == (0, 0)
    assert s.free_blocks + s.cached_blocks == s.total_blocks
