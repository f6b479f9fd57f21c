"""The replica's answer when its engine has failed, outside Serve: a refusal that names the
replica, so the ingress sends the request elsewhere and the router avoids this one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tierserve.records import ErrorRecord, GenerateRequest, RequestOutput, SamplingParams
from tierserve.replica import deployment
from tierserve.replica.deployment import LLMServer
from tierserve.replica.models.embedded import EMBEDDED_MODEL


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LLMServer]:
    monkeypatch.setattr(deployment, "_replica_id", lambda: "replica-7")
    # num_threads given: the replica does not ask Ray for its CPU share (no Ray here).
    s = LLMServer(engine={"model": EMBEDDED_MODEL, "device": "cpu", "num_kv_blocks": 32,
                          "max_num_seqs": 4, "num_threads": 1}, fault_injection=True)
    try:
        yield s
    finally:
        s.engine.shutdown()


def collect(server: LLMServer, max_tokens: int = 4) -> list[RequestOutput | ErrorRecord]:
    async def go() -> list[RequestOutput | ErrorRecord]:
        request = GenerateRequest((1, 2, 3), SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
        return [item async for item in server.generate(request)]

    return asyncio.run(asyncio.wait_for(go(), timeout=60))


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
