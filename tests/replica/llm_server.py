"""One ``LLMServer`` outside Serve, on the embedded model, for the replica deployment's tests
(spans, request ids, engine failures): small, with fault injection on, and named
``replica-7`` so that its refusals can be checked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tierserve.records import ErrorRecord, GenerateRequest, RequestOutput
from tierserve.replica import deployment
from tierserve.replica.deployment import LLMServer
from tierserve.replica.models.embedded import EMBEDDED_MODEL

REPLICA = "replica-7"


@contextmanager
def llm_server() -> Iterator[LLMServer]:
    """The server, shut down on exit. ``num_threads`` is given, so it does not ask Ray for its
    CPU share (no Ray here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deployment, "_replica_id", lambda: REPLICA)
        s = LLMServer(engine={"model": EMBEDDED_MODEL, "device": "cpu", "num_kv_blocks": 32,
                              "max_num_seqs": 4, "num_threads": 1}, fault_injection=True)
        try:
            yield s
        finally:
            s.engine.shutdown()


def collect(server: LLMServer, request: GenerateRequest) -> list[RequestOutput | ErrorRecord]:
    """Everything ``server.generate`` yields for ``request`` (within a minute)."""
    async def go() -> list[RequestOutput | ErrorRecord]:
        return [item async for item in server.generate(request)]

    return asyncio.run(asyncio.wait_for(go(), timeout=60))
